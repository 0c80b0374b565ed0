"""Llama on mstar.ops against transformers' LlamaForCausalLM: llama3 RoPE scaling (frequencies
and table), tiny random checkpoints written by save_pretrained (tied / untied, llama3 / default
rope, with biases) loaded through the loader (logits of prefill, decode and mixed steps in fp32;
greedy tokens of the offline LLM engine, batched, equal to HF generate), config.json of the
older layout, and the presets (shapes and parameter counts of the published models)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from hf_models import check_mixed, check_prefill_then_decode, make_hf_model, random_tokens, torch_only_reference
from mstar.models import load_model, registry
from mstar.models.layers.rotary import Llama3Scaling, RotaryCache, rope_scaling, rope_settings
from mstar.models.loader import build_model, load_tokenizer, resolve_config
from mstar.runtime.engine.request import SamplingParams

VOCAB = 320  # > the byte tokenizer's 259 ids, so the checkpoints serve through the LLM engine
# theta 1e4 at head_dim 32, pretraining context 64: wavelengths from 6 to 4e4, so frequencies fall
# in each of llama3's bands (kept < 16 < blended < 64 < divided by the factor)
TINY_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama_config(*, tied: bool, rope: dict | None = None, bias: bool = False, head_dim: int = 32,
                 heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_parameters=dict(rope or TINY_LLAMA3), max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias, bos_token_id=1, eos_token_id=2)


def hf_inv_freq(config) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return ROPE_INIT_FUNCTIONS["llama3"](config)[0]


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


# --- llama3 rope scaling ------------------------------------------------------------------------
# (theta, head_dim, factor, low, high, original context): Llama 3.1 8B, Llama 3.2 1B / 3B, the tiny one
ROPES = [(500_000.0, 128, 8.0, 1.0, 4.0, 8192), (500_000.0, 64, 32.0, 1.0, 4.0, 8192),
         (500_000.0, 128, 32.0, 1.0, 4.0, 8192), (10_000.0, 32, 8.0, 1.0, 4.0, 64), (10_000.0, 16, 4.0, 2.0, 8.0, 100)]


def _rope_config(theta, dim, factor, low, high, old):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim, max_position_embeddings=4 * old,
                       rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                        "low_freq_factor": low, "high_freq_factor": high,
                                        "original_max_position_embeddings": old})


@pytest.mark.parametrize("theta,dim,factor,low,high,old", ROPES)
def test_llama3_frequencies_equal_transformers(theta, dim, factor, low, high, old):
    cfg = _rope_config(theta, dim, factor, low, high, old)
    s = rope_scaling(cfg)
    assert s == Llama3Scaling(factor, low, high, old)
    base = default_inv_freq(theta, dim)
    ours = s.scale(base)
    assert torch.equal(ours, hf_inv_freq(cfg))
    # every case has frequencies that stay and frequencies that are divided by the factor
    assert (ours == base).any() and (ours == base / factor).any()


@pytest.mark.parametrize("theta,dim,factor,low,high,old", ROPES)
def test_rope_table_matches_transformers_cos_sin(theta, dim, factor, low, high, old):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = _rope_config(theta, dim, factor, low, high, old)
    n = 4 * old
    rope = RotaryCache(n, dim, theta, rope_scaling(cfg))
    rope.rebuild("cpu")
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    half = dim // 2
    torch.testing.assert_close(rope.cos_sin_cache[:, :half], cos[0, :, :half], rtol=0, atol=2e-6)
    torch.testing.assert_close(rope.cos_sin_cache[:, half:], sin[0, :, :half], rtol=0, atol=2e-6)
    # the scaling changes the table (positions past a few hundred differ by far more than that)
    plain = RotaryCache(n, dim, theta)
    plain.rebuild("cpu")
    assert (plain.cos_sin_cache - rope.cos_sin_cache).abs().max() > 0.1


def test_default_rope_table_is_the_ops_table():
    from mstar import ops
    rope = RotaryCache(300, 64, 1e6)
    rope.rebuild("cpu")
    assert rope.scaling is None and torch.equal(rope.cos_sin_cache, ops.build_cos_sin_cache(300, 64, 1e6))


def test_unsupported_rope_is_refused():
    from transformers import Qwen3Config
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 128}
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        build_model(llama_config(tied=True, rope=yarn))
    # Qwen3 computes default rope only: a llama3 config is refused, not run unscaled
    q = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                    intermediate_size=64, vocab_size=64, rope_parameters=dict(TINY_LLAMA3))
    with pytest.raises(ValueError, match="'llama3' is not supported"):
        build_model(q)
    assert rope_settings(llama_config(tied=True), supported=("default", "llama3")) == (10_000.0, 1.0)


# --- tiny checkpoints against transformers ------------------------------------------------------
# (name, tied, rope, biases, sharded safetensors, seed)
CHECKPOINTS = {
    "tied-llama3": (True, TINY_LLAMA3, False, False, 11),
    "untied-llama3-sharded": (False, TINY_LLAMA3, False, True, 12),
    "untied-default-bias": (False, {"rope_type": "default", "rope_theta": 500_000.0}, True, False, 13),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    tied, rope, bias, sharded, seed = CHECKPOINTS[request.param]
    hf = make_hf_model(llama_config(tied=tied, rope=rope, bias=bias), seed=seed)
    d = tmp_path_factory.mktemp(f"llama-{request.param}")
    hf.save_pretrained(d, **({"max_shard_size": "200KB"} if sharded else {}))
    from mstar.models.tokenizer import byte_tokenizer
    byte_tokenizer().save_pretrained(d)
    files = sorted(os.listdir(d))
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
    assert ("model.safetensors.index.json" in files) == sharded
    assert json.loads((d / "config.json").read_text())["model_type"] == "llama"
    return hf, load_model(str(d), progress=False), str(d)


def test_weight_names_and_shapes_match_transformers(checkpoint):
    hf, model, _ = checkpoint
    assert type(model).__name__ == "LlamaForCausalLM"
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if model.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert {k: s.shape for k, s in model.expected_weights().items()} == theirs
    assert model.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (model.rope.scaling is not None) == (hf.config.rope_parameters["rope_type"] == "llama3")


def test_untied_head_is_the_checkpoint_head(checkpoint):
    hf, model, _ = checkpoint
    if model.tie_word_embeddings:
        assert model.lm_head_weight() is model.model.embed_tokens.weight
    else:
        assert torch.equal(model.lm_head_weight(), hf.lm_head.weight)
        assert not torch.equal(model.lm_head_weight(), model.model.embed_tokens.weight)


def test_prefill_and_decode_match_transformers(checkpoint):
    """fp32 logits within 1e-4 of HF (relative to the largest HF logit), positions up to 100:
    past the 64-token pretraining context of the llama3 checkpoints."""
    hf, model, _ = checkpoint
    check_prefill_then_decode(hf, model, lengths=[3, 16, 97], decode_steps=4, vocab=VOCAB, tol=1e-4)


def test_mixed_steps_match_transformers(checkpoint):
    hf, model, _ = checkpoint
    check_mixed(hf, model, vocab=VOCAB, tol=1e-4)


def test_cache_spec(checkpoint):
    _, model, _ = checkpoint
    spec = model.cache_spec()
    assert len(spec.attention) == 3 and not spec.state
    assert spec.kv_bytes_per_token(model.dtype) == 3 * 2 * 2 * 32 * 4


def _hf_generate(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad(), torch_only_reference():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_llm_greedy_equals_hf_generate(checkpoint):
    """The offline LLM engine, all prompts in one batch (different lengths, pages of 16), greedy:
    exactly HF generate's tokens for each prompt alone."""
    from mstar.runtime.engine.llm import LLM
    hf, _, path = checkpoint
    prompts = [random_tokens(n, VOCAB, seed=300 + n) for n in (2, 9, 30, 75)]
    n_new = 12
    m = LLM(path, dtype="float32", device="cpu", max_model_len=256, page_size=16, max_num_seqs=4)
    try:
        outs = m.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == [_hf_generate(hf, p, n_new) for p in prompts]
        text = "Llama, hello"
        (o,) = m.generate(text, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert o.token_ids == _hf_generate(hf, m.tokenizer.encode(text), 6)
    finally:
        m.close()


# --- config.json as older transformers saved it -------------------------------------------------
def test_checkpoint_config_of_the_older_layout(tmp_path):
    """Llama 3.x checkpoints carry rope_theta at the top and the scaling as rope_scaling, eos ids
    in generation_config.json too."""
    raw = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=128,
               intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=True,
               rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 128, "rope_type": "llama3"},
               bos_token_id=128000, eos_token_id=128001)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert registry.family_of(str(tmp_path)).name == "llama"
    cfg = resolve_config(str(tmp_path))
    assert rope_settings(cfg, supported=("default", "llama3"))[0] == 500_000.0
    assert rope_scaling(cfg) == Llama3Scaling(32.0, 1.0, 4.0, 128)
    assert list(cfg.eos_token_id) == [128001, 128009]
    model = build_model(cfg, device="cpu")
    assert model.rope.scaling == Llama3Scaling(32.0, 1.0, 4.0, 128)
    assert model.eos_token_ids == (128001, 128009)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cos, _ = LlamaRotaryEmbedding(cfg)(torch.zeros(1), torch.arange(512)[None])
    torch.testing.assert_close(model.rope.cos_sin_cache[:, :16], cos[0, :, :16], rtol=0, atol=2e-6)


# --- presets ------------------------------------------------------------------------------------
def llama_param_count(vocab, hidden, layers, heads, kv_heads, head_dim, intermediate, tied) -> int:
    """By hand: embedding (and an untied head), per layer q / o (hidden x heads * head_dim), k / v
    (hidden x kv_heads * head_dim), gate / up / down (hidden x intermediate) and two norms, final norm."""
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = attn + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


# (preset, shape by hand, published size in billions)
PRESET_SHAPES = {
    "llama-3.2-1b": ((128256, 2048, 16, 32, 8, 64, 8192, True), 1.24),
    "llama-3.2-3b": ((128256, 3072, 28, 24, 8, 128, 8192, True), 3.21),
    "llama-3.1-8b": ((128256, 4096, 32, 32, 8, 128, 14336, False), 8.03),
    "orpheus-3b": ((156940, 3072, 28, 24, 8, 128, 8192, True), 3.30),
}


def test_presets_are_registered():
    names = set(registry.presets())
    assert set(PRESET_SHAPES) | {"tiny-llama"} <= names
    for name in list(PRESET_SHAPES) + ["tiny-llama"]:
        # Orpheus is a Llama checkpoint served by its own family (the audio-token glue)
        assert registry.family_of(name).name == ("orpheus" if name == "orpheus-3b" else "llama")
        assert resolve_config(name).model_type == "llama"
    assert registry.family_of_model_type("llama").name == "llama"


@pytest.mark.parametrize("name", list(PRESET_SHAPES))
def test_preset_shapes_and_parameter_counts(name):
    from transformers import AutoModelForCausalLM
    shape, billions = PRESET_SHAPES[name]
    cfg = resolve_config(name)
    model = build_model(cfg, device="meta")
    n = model.num_parameters()
    assert n == llama_param_count(*shape)
    assert abs(n / 1e9 - billions) < 0.006, n
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert {k: s.shape for k, s in model.expected_weights().items()} == theirs
    assert model.rope.scaling == Llama3Scaling(32.0 if name != "llama-3.1-8b" else 8.0, 1.0, 4.0, 8192)


def test_orpheus_preset():
    cfg = resolve_config("orpheus-3b")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (156940, 3072, 28, 24, 8, 128, 8192)
    assert cfg.max_position_embeddings == 131072 and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 500_000.0 and cfg.bos_token_id == 128000
    model = build_model(cfg, device="meta")
    assert model.eos_token_ids == (128258, 128009)  # end of speech first: the TTS stop token
    # 3.30 B tied; an untied head would add the 156940 x 3072 embedding again: 3.78 B
    assert model.num_parameters() == 3_300_867_072
    assert llama_param_count(156940, 3072, 28, 24, 8, 128, 8192, False) == 3_782_986_752


def test_info_cli_orpheus():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "mstar.models", "info", "orpheus-3b", "--no-config"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "LlamaForCausalLM" in out and "F x 28" in out
    assert "3,300,867,072" in out and "tied embeddings: True; vocab 156940; hidden 3072" in out
    assert f"KV cache per token (bf16): {28 * 2 * 8 * 128 * 2:,} B" in out
    assert "eos token ids: [128258, 128009]" in out
    r = subprocess.run([sys.executable, "-m", "mstar.models", "list"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    listed = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    assert set(PRESET_SHAPES) | {"tiny-llama"} <= listed


def test_tiny_llama_preset():
    from model_harness import Harness
    model, tok = load_model("tiny-llama"), load_tokenizer("tiny-llama")
    assert type(model).__name__ == "LlamaForCausalLM" and not model.tie_word_embeddings
    assert set(model.eos_token_ids) == {tok.convert_tokens_to_ids("<|im_end|>"),
                                        tok.convert_tokens_to_ids("<|endoftext|>")}
    # its llama3 scaling keeps some frequencies, divides some, blends some
    s = model.rope.scaling
    base = default_inv_freq(model.rope.base, model.rope.rotary_dim)
    scaled = s.scale(base)
    kept, divided = scaled == base, scaled == base / s.factor
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    h = Harness(model, max_len=128)
    logits = h.step(prefill={0: ids})[0][-1]
    out = []
    for _ in range(24):
        out.append(int(logits.argmax()))
        logits = h.step(decode={0: out[-1]})[0][-1]
    assert len(set(out)) > 6, out


def test_tiny_llama_serves_through_the_llm():
    from mstar.runtime.engine.llm import LLM
    m = LLM("tiny-llama", dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4)
    try:
        outs = m.generate(["Hello", "a much longer prompt than the first"],
                          SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [5, 5] and all(o.finish_reason == "length" for o in outs)
    finally:
        m.close()


# --- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-3), (torch.bfloat16, 6e-2)], ids=["fp32", "bf16"])
def test_tiny_checkpoint_on_gpu_matches_transformers(dtype, tol, tmp_path):
    """head_dim 128 as the presets (the fast rotary and attention kernels of the real shapes)."""
    hf = make_hf_model(llama_config(tied=False, head_dim=128, heads=4, kv_heads=2), seed=14)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype=dtype, device="cuda", progress=False)
    check_prefill_then_decode(hf, model, lengths=[5, 17, 90, 1], decode_steps=3, vocab=VOCAB, page_size=16, tol=tol)
    check_mixed(hf, model, vocab=VOCAB, page_size=16, tol=tol)
