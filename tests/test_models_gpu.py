"""mstar's models on the GPU with the fast backends (FlashInfer / Triton / fla where they
load): tiny checkpoints against transformers (fp32 on the CPU), and a full-size random
Qwen3.5-0.8B whose fast-backend logits must match the reference backends'.
Marked `gpu`: skipped on a CPU machine; run on the GPU host with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from hf_models import (check_mixed, check_prefill_then_decode, make_hf_model, qwen3_5_config, qwen3_config,
                       random_tokens)
from model_harness import Harness, rel_err
from mstar import knobs, ops
from mstar.models import load_model

pytestmark = pytest.mark.gpu
VOCAB = 512


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-3), (torch.bfloat16, 6e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_tiny_checkpoint_on_gpu_matches_transformers(family, dtype, tol, tmp_path):
    cfg = qwen3_5_config(True, VOCAB, key_dim=64, value_dim=64) if family == "qwen3_5" else qwen3_config(False, VOCAB)
    hf = make_hf_model(cfg, seed=9)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype=dtype, device="cuda", progress=False)
    check_prefill_then_decode(hf, model, lengths=[5, 17, 70, 1], decode_steps=3, vocab=VOCAB, page_size=16, tol=tol)
    check_mixed(hf, model, vocab=VOCAB, page_size=16, tol=tol)


def prefill_decode_logits(model, seqs: dict, lengths: list[int]) -> torch.Tensor:
    """The last logits of a prefill step of seqs[i][:lengths[i]] (all rows in one step), then of
    one decode step of each row's next token: [2 x rows, vocab]."""
    h = Harness(model, max_seqs=len(lengths), max_len=160, page_size=16)
    out = h.step(prefill={i: s[:n] for i, (s, n) in enumerate(zip(seqs.values(), lengths))})
    lg = [out[i][-1] for i in range(len(lengths))]
    out = h.step(decode={i: seqs[i][n] for i, n in enumerate(lengths)})
    lg += [out[i][-1] for i in range(len(lengths))]
    return torch.stack(lg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_full_size_qwen3_5_fast_backends_match_reference(dtype):
    model = load_model("qwen3.5-0.8b", dtype=dtype, device="cuda", random_weights=True, seed=1)
    lengths = [3, 40, 130]
    seqs = {i: random_tokens(n + 2, 248320, 20 + i) for i, n in enumerate(lengths)}

    def run():
        return prefill_decode_logits(model, seqs, lengths)

    fast = run()
    print("backends:", {e.name: e.selected("cuda") for e in ops.all_ops()})
    with knobs.override(MSTAR_BACKENDS="*=reference"):
        ref = run()
    assert torch.isfinite(fast).all()
    err = rel_err(fast, ref)
    cos = torch.nn.functional.cosine_similarity(fast.double(), ref.double(), dim=-1).min().item()
    print(f"{dtype}: rel err {err:.2e}, min cosine {cos:.6f}")
    if dtype == torch.float32:
        # fla's chunk kernels (the GDN prefill) multiply float32 in TF32 (tl.dot's default): 6.6-7.2e-3
        # at seeds 1-3 (mstar/bench/tools/fast_vs_reference_probe.py, notes/gpu-2026-12-01-allreduce-norm.md); with the GDN prefill on
        # the reference, every other fast kernel stays within 1.2e-5
        assert err < 2e-2 and cos > 0.9999, (err, cos)
        with knobs.override(MSTAR_BACKENDS="gdn_prefill=reference,gdn_prefill_fused=composed"):
            no_tf32 = run()
        assert rel_err(no_tf32, ref) < 1e-4, rel_err(no_tf32, ref)
    else:  # two bf16 paths through 24 layers drift apart a little, row by row
        assert cos > 0.99, cos
