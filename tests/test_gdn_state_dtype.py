"""MSTAR_GDN_STATE_DTYPE: the Gated DeltaNet recurrent state pool in float32 or bfloat16; the default
(auto) follows the weights: bfloat16 for half-precision models, float32 for float32 ones.

With float32 weights the default leaves the cache spec, and so every output, as it was. bfloat16 halves the pool
(and its snapshots); the ops still compute in float32 and round only when they store; the
first token (computed from the prompt before any state is read back) is unchanged; a TP
follower takes rank 0's dtype whatever its own knob says."""

from __future__ import annotations

import torch

from engine_helpers import POOL_SEED, engine, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar import knobs
from mstar.ops import gdn
from mstar.runtime.engine.request import EngineRequest, SamplingParams

PS = prompts(4, 5, 30, seed=POOL_SEED)
G = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _reqs():
    return [EngineRequest(str(i), p, G) for i, p in enumerate(PS)]


def test_default_follows_the_weights():
    from mstar.models.base import state_dtype_for
    assert knobs.value("MSTAR_GDN_STATE_DTYPE") == "auto"
    assert state_dtype_for(torch.float32) == torch.float32
    assert state_dtype_for(torch.bfloat16) == state_dtype_for(torch.float16) == torch.bfloat16
    with knobs.override(MSTAR_GDN_STATE_DTYPE="float32"):
        assert state_dtype_for(torch.bfloat16) == torch.float32
    with knobs.override(MSTAR_GDN_STATE_DTYPE="bfloat16"):
        assert state_dtype_for(torch.float32) == torch.bfloat16
    core = engine("qwen3.5", page_size=8, max_model_len=64, max_num_seqs=4, dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in core.cm.caches.recurrent_states)


def test_float32_weights_keep_a_float32_state_and_bfloat16_halves_the_pool():
    core = engine("qwen3.5", page_size=8, max_model_len=64, max_num_seqs=4)
    assert core.cm.caches.recurrent_states[0].dtype == torch.float32
    spec32 = core.model.cache_spec()
    with knobs.override(MSTAR_GDN_STATE_DTYPE="bfloat16"):
        spec16 = core.model.cache_spec()
    assert spec32.state_dtype == torch.float32 and spec16.state_dtype == torch.bfloat16
    conv = sum(s.conv_dim * (s.conv_kernel - 1) * 4 for s in spec32.state)  # conv state in float32 here
    assert spec16.state_bytes_per_sequence(torch.float32) - conv == (
        spec32.state_bytes_per_sequence(torch.float32) - conv) // 2


def test_bfloat16_state_runs_and_keeps_the_first_token():
    ref = run_all(engine("qwen3.5", page_size=8, max_model_len=64, max_num_seqs=4), _reqs())
    with knobs.override(MSTAR_GDN_STATE_DTYPE="bfloat16"):
        core = engine("qwen3.5", page_size=8, max_model_len=64, max_num_seqs=4)
        assert all(t.dtype == torch.bfloat16 for t in core.cm.caches.recurrent_states)
        got = run_all(core, _reqs())
    assert all(len(got[k][0]) == 8 and got[k][1] == "length" for k in got)
    assert [got[k][0][0] for k in sorted(got)] == [ref[k][0][0] for k in sorted(ref)]


def test_decode_op_rounds_only_the_stored_state():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,))))
    b, h, dk, dv = 3, 2, 8, 16
    q, k = (torch.nn.functional.normalize(torch.randn(b, h, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(b, h, dv, generator=g)
    gg, beta = -torch.rand(b, h, generator=g), torch.rand(b, h, generator=g)
    pool32 = torch.randn(5, h, dk, dv, generator=g).to(torch.bfloat16).float()  # representable in bf16
    pool16 = pool32.to(torch.bfloat16)
    slots = torch.tensor([4, 0, 2])
    ref = gdn.gdn_decode.backends["reference"].fn
    o32 = ref(q, k, v, gg, beta, pool32, slots, dk ** -0.5)
    o16 = ref(q, k, v, gg, beta, pool16, slots, dk ** -0.5)
    assert torch.equal(o16, o32)  # the output is computed before the state is rounded
    assert pool16.dtype == torch.bfloat16
    assert torch.equal(pool16[slots], pool32[slots].to(torch.bfloat16))


def test_tp_follower_takes_rank0s_state_dtype():
    """Rank 0 sends its state dtype with the cache sizes; tokens at tp=2 equal tp=1's with it."""
    from tp_helpers import closed_cleanly, tp_engine
    with knobs.override(MSTAR_GDN_STATE_DTYPE="bfloat16"):
        one = run_all(tp_engine("qwen3.5", 1), _reqs())
        core = tp_engine("qwen3.5", 2)
    try:
        assert core.cm.caches.recurrent_states[0].dtype == torch.bfloat16
        two = run_all(core, _reqs())
        # the follower's own knob is the default (float32): the override is this process's only
        assert core.tp.follower_state_dtype == ["bfloat16"]
    finally:
        closed_cleanly(core)
    assert two == one
