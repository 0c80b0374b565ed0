"""The per-rank memory plan (mstar/models/memory_plan.py, `python -m mstar.models info NAME --tp N`),
from meta tensors only: weight bytes per rank add up to the full model, the 27B at tp=4 holds a
quarter of ~54 GB per rank and fits 128 sequences of 512 tokens on a 139 GiB H200, the sizing
agrees with the runtime's size_caches, and tp=1 agrees with `info`."""

from __future__ import annotations

import pytest
import torch

from mstar.models import memory_plan as mp
from mstar.models import resolve_config

GIB = 1 << 30
# The tensors every rank of a Qwen3.5 model holds whole: the RMSNorm weights (per layer, the GDN
# output norm, q/k norms of the attention layers, the final norm). KV heads are replicated only
# when tp exceeds num_key_value_heads (the 27B has 4: tp=8 keeps each KV head on 2 ranks).
QWEN3_5_REPLICATED = {"linear_attn.norm", "input_layernorm", "post_attention_layernorm",
                      "self_attn.q_norm", "self_attn.k_norm", "model.norm"}


@pytest.fixture(scope="module")
def cfg27():
    return resolve_config("qwen3.5-27b")


def _unique_bytes(ranks, num_kv_heads: int) -> int:
    """Bytes over all ranks, every tensor counted once: replicated tensors once, shared KV
    heads once (each is held by size // num_kv_heads ranks), vocabulary padding not at all."""
    size = len(ranks)
    total = sum(r.weight_bytes for r in ranks)
    total -= (size - 1) * ranks[0].replicated_bytes
    kv = sum(r.replicated_kv_bytes for r in ranks)
    if kv:
        total -= kv - kv * num_kv_heads // size
    return total - sum(r.padding_bytes for r in ranks)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_27b_rank_weights_add_up_to_the_full_model(cfg27, size):
    full = mp.rank_model(cfg27, 0, 1)
    assert all(p.is_meta for p in full.parameters())
    full_bytes = 2 * full.num_parameters()
    ranks = [mp.rank_memory(cfg27, r, size) for r in range(size)]
    assert _unique_bytes(ranks, cfg27.num_key_value_heads) == full_bytes
    for r in ranks:
        assert r.weight_bytes == ranks[0].weight_bytes  # every rank alike (no vocab padding: 248320 = 8 x 31040)
        assert r.padding_bytes == 0
        if size == 1:
            assert r.replicated_bytes == 0 and r.weight_bytes == full_bytes
        else:
            assert set(r.replicated_names) == QWEN3_5_REPLICATED
            # the norms: 64 x 2 layer norms + 48 GDN norms (head dim 128) + 16 x (q, k norms of 256) + final
            assert r.replicated_bytes == 2 * (64 * 2 * 5120 + 48 * 128 + 16 * 2 * 256 + 5120)
        if size == 8:
            # 16 attention layers x k and v of one 256-wide KV head x 5120 inputs, bf16
            assert r.replicated_kv_bytes == 16 * 2 * 256 * 5120 * 2
        else:
            assert r.replicated_kv_bytes == 0
        assert r.kv_bytes_per_token == 16 * 2 * (4 // min(size, 4)) * 256 * 2
        # the recurrent state in bfloat16, as the weights (MSTAR_GDN_STATE_DTYPE=auto)
        assert r.state_bytes_per_sequence * size == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 2)


def test_vocab_padding_is_counted_once():
    """tiny-qwen3 (vocab 259, tied head) at tp=2: 2 x 130 rows, one of them padding."""
    cfg = resolve_config("tiny-qwen3")
    full_bytes = 2 * mp.rank_model(cfg, 0, 1).num_parameters()
    ranks = [mp.rank_memory(cfg, r, 2) for r in range(2)]
    assert [r.padding_bytes for r in ranks] == [0, 2 * cfg.hidden_size]
    assert _unique_bytes(ranks, cfg.num_key_value_heads) == full_bytes


def test_27b_tp4_plan_on_an_h200():
    p = mp.plan("qwen3.5-27b", 4, gpu_mem_gib=139, max_num_seqs=128, context=512, page_size=16)
    assert 53.5e9 < p.full_weight_bytes < 54.5e9  # ~54 GB of bf16 weights
    assert abs(p.rank0.weight_bytes - p.full_weight_bytes / 4) < 0.001 * p.full_weight_bytes
    assert p.rank0.kv_bytes_per_token == 16_384
    assert p.fits and p.max_seqs >= 128
    u = p.at_max_num_seqs
    assert u.num_pages == 128 * 32 + 1 and u.snapshot_slots == 4 * 128
    assert "fits" in "\n".join(p.lines())


@pytest.mark.parametrize("name,tp,gib,ctx", [("qwen3.5-27b", 4, 139, 512), ("qwen3.5-27b", 2, 40, 4096),
                                           ("qwen3-8b", 2, 24, 2048)])
def test_sizing_matches_the_runtime(name, tp, gib, ctx):
    """The plan's budget, put into EngineConfig.cache_memory_bytes, gives the runtime's size_caches
    the same pages and snapshot slots; max_seqs is the most the runtime can hold in full.
    (The first case fits 128 sequences, the other two do not.)"""
    from mstar.runtime.engine.config import EngineConfig, size_caches
    cuda = torch.device("cuda")  # only names the device: cache_memory_bytes is given, no CUDA call
    p = mp.plan(name, tp, gpu_mem_gib=gib, max_num_seqs=128, context=ctx, page_size=16)
    spec = mp.rank_model(resolve_config(name), 0, tp).cache_spec()
    pps = -(-ctx // 16)

    def sizes(n):
        cfg = EngineConfig(model=name, max_num_seqs=n, max_model_len=ctx, page_size=16,
                           cache_memory_bytes=p.budget_bytes)
        return size_caches(cfg, spec, torch.bfloat16, cuda, ctx)

    s = sizes(128)
    assert s.num_pages <= p.at_max_num_seqs.num_pages
    assert (s.num_pages == p.at_max_num_seqs.num_pages) == p.fits == (p.max_seqs >= 128)
    assert s.num_snapshot_slots == p.at_max_num_seqs.snapshot_slots
    n = p.max_seqs
    assert n > 0
    assert sizes(n).num_pages == n * pps + 1
    assert sizes(n + 1).num_pages < (n + 1) * pps + 1


def test_08b_tp1_matches_info():
    from mstar.models.__main__ import info
    out = info("qwen3.5-0.8b", show_config=False)
    p = mp.plan("qwen3.5-0.8b", 1)
    r = p.rank0
    assert r.weight_bytes == p.full_weight_bytes == 2 * 752_393_024
    assert f"bf16 weights {mp.human_bytes(r.weight_bytes)}" in out
    assert f"KV cache per token (bf16): {mp.human_bytes(r.kv_bytes_per_token)} " in out
    assert r.kv_bytes_per_token == 12_288
    assert f"{mp.human_bytes(r.state_bytes_per_sequence)} over 18 Gated DeltaNet layers" in out
    assert r.replicated_bytes == r.replicated_kv_bytes == r.padding_bytes == 0


def test_cli_prints_the_plan(capsys):
    from mstar.models.__main__ import main
    assert main(["info", "qwen3.5-27b", "--no-config", "--tp", "4", "--gpu-mem-gib", "139",
                 "--max-num-seqs", "128", "--context", "512"]) == 0
    out = capsys.readouterr().out
    assert "parameters (text model): 26,895,998,464" in out  # what info printed before
    assert "memory plan, tp 4" in out
    assert "weights per rank: 13,449,011,456 B" in out
    assert "KV cache per token per rank: 16,384 B" in out
    assert "max-num-seqs 128 x 512 tokens: fits" in out
    assert main(["info", "qwen3.5-27b", "--no-config"]) == 0
    assert "memory plan" not in capsys.readouterr().out  # without --tp, as before


def test_tp_that_cannot_split_is_refused():
    with pytest.raises(ValueError, match="tensor parallel size 3 must divide"):
        mp.plan("qwen3.5-27b", 3)


def test_cli_refuses_a_tp_that_cannot_split(capsys):
    from mstar.models.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["info", "qwen3.5-27b", "--no-config", "--tp", "3"])
    assert e.value.code == 2
    assert "tensor parallel size 3 must divide num_key_value_heads (4" in capsys.readouterr().err
