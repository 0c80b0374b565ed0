"""Qwen3 (dense) on mstar.ops against transformers' Qwen3ForCausalLM (tiny random
checkpoints, CPU, fp32): full prefill, token-by-token decode, mixed steps."""

from __future__ import annotations

import pytest

from hf_models import check_mixed, check_prefill_then_decode, make_hf_model, qwen3_config
from mstar.models import load_model

VOCAB = 512


@pytest.fixture(scope="module", params=[("tied", "single"), ("untied", "sharded")], ids=lambda p: "-".join(p))
def checkpoint(request, tmp_path_factory):
    tied = request.param[0] == "tied"
    hf = make_hf_model(qwen3_config(tied, VOCAB), seed=3 if tied else 4)
    d = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(d, **({"max_shard_size": "200KB"} if request.param[1] == "sharded" else {}))
    return hf, load_model(str(d), progress=False)


def test_weight_names_and_shapes_match_transformers(checkpoint):
    hf, model = checkpoint
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if model.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert {k: s.shape for k, s in model.expected_weights().items()} == theirs


def test_prefill_and_decode_match_transformers(checkpoint):
    hf, model = checkpoint
    check_prefill_then_decode(hf, model, lengths=[3, 16, 33], decode_steps=4, vocab=VOCAB)


def test_mixed_steps_match_transformers(checkpoint):
    hf, model = checkpoint
    check_mixed(hf, model, vocab=VOCAB)


def test_cache_spec(checkpoint):
    _, model = checkpoint
    spec = model.cache_spec()
    assert len(spec.attention) == 3 and not spec.state
    assert spec.kv_bytes_per_token(model.dtype) == 3 * 2 * 2 * 64 * 4
