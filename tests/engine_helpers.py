"""Test-only helpers for the engine tests: tiny random Qwen3.5 / Qwen3 checkpoints written
by transformers (save_pretrained, with the byte tokenizer) into a temp dir once per
process, the HF greedy reference (cached per prompt), and engine construction.

HF's Qwen3.5 picks the fla Triton kernels when fla is installed, which cannot run on a
CPU-only machine; the HF reference runs under hf_models.torch_only_reference().
"""

from __future__ import annotations

import functools
import os
import random
import tempfile

import pytest
import torch

from hf_models import make_hf_model, torch_only_reference

VOCAB = 320  # > 259 ids of the byte tokenizer
EOS = 258  # <|im_end|> of the byte tokenizer


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two
    spinning OpenMP threads per process make runs several times slower. Import this
    fixture into a test module to run its tests with one thread (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Per kind: the shapes that differ. "-gpu" kinds (GPU tests) have the per-head shapes of the
# 0.8B / 0.6B presets (attention head_dim 256 / 128; GDN 16 x 128 heads, conv width 6144) in a
# small model, so that FlashInfer's and fla's kernels are the ones a kernel cache built for the
# presets already holds (no minutes of first-use builds).
_SHAPES = {
    "qwen3.5": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, partial_rotary_factor=0.5),
    "qwen3.5-gpu": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                        linear_value_head_dim=128, partial_rotary_factor=0.25),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen3-gpu": dict(hidden_size=256, intermediate_size=512, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128),
}


def _config(kind: str):
    if kind not in _SHAPES:
        raise ValueError(kind)
    shape = dict(_SHAPES[kind])
    common = dict(vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  eos_token_id=EOS)
    if kind.startswith("qwen3.5"):
        from transformers import Qwen3_5TextConfig
        rope = {"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": shape.pop("partial_rotary_factor")}
        return Qwen3_5TextConfig(
            num_hidden_layers=4, linear_conv_kernel_dim=4, rope_parameters=rope,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            **shape, **common)
    from transformers import Qwen3Config
    return Qwen3Config(num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       **shape, **common)


@functools.lru_cache(maxsize=None)
def hf_model(kind: str):
    """The transformers model (fp32, eval), random weights with enough spread that the
    next-token distribution is far from uniform (hf_models.make_hf_model)."""
    return make_hf_model(_config(kind), seed=1234)


_DIR = None


@functools.lru_cache(maxsize=None)
def model_dir(kind: str) -> str:
    """A checkpoint dir (config.json + safetensors + byte tokenizer) for `kind`."""
    global _DIR
    if _DIR is None:
        _DIR = tempfile.mkdtemp(prefix="mstar-engine-tests-")
    path = os.path.join(_DIR, kind)
    hf_model(kind).save_pretrained(path)
    from mstar.models.tokenizer import byte_tokenizer
    byte_tokenizer().save_pretrained(path)
    return path


@functools.lru_cache(maxsize=None)
def _hf_greedy(kind: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    model = hf_model(kind)
    ids = torch.tensor([list(prompt)])
    with torch.no_grad(), torch_only_reference():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(kind: str, prompt: list[int], n: int = 32) -> list[int]:
    """HF generate (do_sample=False, eos ignored), the prompt alone, no padding."""
    return list(_hf_greedy(kind, tuple(prompt), n))


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine(kind: str, **opts):
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    opts.setdefault("dtype", "float32")
    opts.setdefault("device", "cpu")
    opts.setdefault("max_model_len", 512)
    return EngineCore(EngineConfig(model=model_dir(kind), **opts))


def llm(kind: str, **opts):
    from mstar.runtime.engine.llm import LLM
    opts.setdefault("dtype", "float32")
    opts.setdefault("device", "cpu")
    opts.setdefault("max_model_len", 512)
    return LLM(model_dir(kind), **opts)


def greedy_requests(ps, max_tokens, prefix: str = "") -> list:
    """EngineRequests "<prefix>i" for prompts ps, greedy, EOS ignored; max_tokens: an int, or a
    function of the index i."""
    from mstar.runtime.engine.request import EngineRequest, SamplingParams
    n = max_tokens if callable(max_tokens) else (lambda i: max_tokens)
    return [EngineRequest(f"{prefix}{i}", p, SamplingParams(max_tokens=n(i), temperature=0.0, ignore_eos=True))
            for i, p in enumerate(ps)]


def run_all(core, reqs) -> dict:
    """Add EngineRequests, step to the end; {request_id: (token ids, finish_reason)}."""
    for r in reqs:
        core.add_request(r)
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    fin: dict[str, str] = {}
    while core.has_unfinished():
        for o in core.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                fin[o.request_id] = o.finish_reason
    return {k: (v, fin.get(k)) for k, v in toks.items()}


def assert_no_leaks(core) -> None:
    """Nothing queued or running, and every page / slot free once the prefix cache is dropped."""
    assert not core.has_unfinished()
    assert not core.scheduler.running and not core.scheduler.waiting
    core.cm.check()
    core.reset_prefix_cache()
    s = core.cm.stats()
    assert s.free_pages == s.total_pages, s
    assert s.used_pages == 0 and s.cached_pages == 0, s
    assert s.free_slots == s.total_slots, s
    assert s.snapshot_slots_free == s.snapshot_slots_total, s
    assert s.offloaded_requests == 0, s
    assert s.cross_slots_free == s.cross_slots_total, s  # encoder-decoder models: cross K/V slots
    assert core.sampler.num_free == core.sampler.max_rows
    masks = getattr(core, "token_masks", None)
    assert masks is None or not masks.active, "suppression masks left on released sampler rows"
    core.cm.check()
POOL_SEED = 21


class NoHostSync:
    """While active, reading a tensor's values on the host raises (CPU stands in for a device):
    what a step that must not synchronise may not do."""
    NAMES = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, what: str = "a host read of a tensor"):
        self.what = what

    def __enter__(self):
        self._saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def fail(*a, **k):
            raise AssertionError(self.what)
        for n in self.NAMES:
            setattr(torch.Tensor, n, fail)
        return self

    def __exit__(self, *exc):
        for n, f in self._saved.items():
            setattr(torch.Tensor, n, f)
        return False
