"""Qwen3.5 on mstar.ops against transformers' Qwen3_5ForCausalLM (tiny random checkpoints,
CPU, fp32): full prefill, token-by-token decode carrying KV + GDN state, mixed steps."""

from __future__ import annotations

import os

import pytest
import torch

from hf_models import check_mixed, check_prefill_then_decode, make_hf_model, qwen3_5_config
from mstar.models import load_model

VOCAB = 512


@pytest.fixture(scope="module", params=[("tied", "sharded"), ("untied", "single")], ids=lambda p: "-".join(p))
def checkpoint(request, tmp_path_factory):
    tied = request.param[0] == "tied"
    hf = make_hf_model(qwen3_5_config(tied, VOCAB), seed=1 if tied else 2)
    d = tmp_path_factory.mktemp("qwen3_5")
    if request.param[1] == "sharded":
        hf.save_pretrained(d, max_shard_size="200KB")
        assert os.path.isfile(d / "model.safetensors.index.json")
    else:
        hf.save_pretrained(d)
        assert os.path.isfile(d / "model.safetensors")
    return hf, load_model(str(d), progress=False)


def test_weight_names_and_shapes_match_transformers(checkpoint):
    hf, model = checkpoint
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if model.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    ours = {k: s.shape for k, s in model.expected_weights().items()}
    assert ours == theirs
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_prefill_and_decode_match_transformers(checkpoint):
    hf, model = checkpoint
    # 70 > 64 covers a multi-chunk GDN prefill; 1 a one-token prompt
    check_prefill_then_decode(hf, model, lengths=[5, 17, 70, 1], decode_steps=4, vocab=VOCAB)


def test_mixed_steps_match_transformers(checkpoint):
    hf, model = checkpoint
    check_mixed(hf, model, vocab=VOCAB, page_size=16)


def test_model_api(checkpoint):
    _, model = checkpoint
    spec = model.cache_spec()
    cfg = model.config
    assert len(spec.attention) == cfg.layer_types.count("full_attention")
    assert len(spec.state) == cfg.layer_types.count("linear_attention")
    s = spec.state[0]
    assert (s.conv_dim, s.conv_kernel, s.num_heads, s.key_dim, s.value_dim) == (2 * 2 * 32 + 4 * 48, 4, 4, 32, 48)
    assert spec.attention[0].num_kv_heads == 2 and spec.attention[0].head_dim == 64
    assert model.eos_token_ids == (2, 3)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    logits = model.compute_logits(torch.randn(3, cfg.hidden_size))
    assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32


def test_bf16_runs_close_to_fp32(checkpoint, tmp_path):
    hf, _ = checkpoint
    from hf_models import hf_logits, random_tokens
    from model_harness import Harness
    hf.save_pretrained(tmp_path)
    m = load_model(str(tmp_path), dtype=torch.bfloat16, progress=False)
    ids = random_tokens(20, VOCAB, 7)
    out = Harness(m).step(prefill={0: ids})[0]
    ref = hf_logits(hf, ids)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() / ref.abs().max() < 0.1


def test_prefix_snapshots_resume_like_a_fresh_prefill(checkpoint):
    """Snapshots taken mid-prefill (prefix cache) let another sequence continue from them:
    its logits equal transformers' over the whole sequence."""
    from hf_models import TOL, hf_logits, random_tokens
    from model_harness import Harness, rel_err
    hf, model = checkpoint
    a = random_tokens(50, VOCAB, 31)
    other = random_tokens(12, VOCAB, 32)
    h = Harness(model, max_seqs=4, max_len=96, page_size=4)
    spare = h.spare_slots()
    # seq 0 prefills after seq 1 in the same step, so snapshot indices are relative to the
    # first prefill token, not to the row; snapshots at 20 tokens and at 45 tokens
    h.step(prefill={1: other, 0: a[:48]}, snapshots={0: [(19, spare[0]), (44, spare[1])]})
    for n, slot, seq in ((20, spare[0], 2), (45, spare[1], 3)):
        b = a[:n] + random_tokens(9, VOCAB, 40 + n)
        h.fork(seq, 0, n, slot)
        out = h.step(prefill={seq: b[n:]})[seq]
        e = rel_err(out, hf_logits(hf, b)[n:])
        assert e < TOL, f"resume after {n}: rel err {e:.2e}"
