"""The launches `python -m mstar.bench.tools.probe_gdn_decode` times compute the op's decode step at
every value-column block it tries (Triton's CPU interpreter), float32 and bfloat16 state, against
the op's reference."""

from __future__ import annotations

from triton_interpreter import run_interpreted

_SCRIPT = r"""
import json, torch
from mstar.bench.tools import probe_gdn_decode as probe
from mstar.ops import gdn
torch.manual_seed(int(torch.randint(1 << 30, ())))
out = []
for dtype in (torch.float32, torch.bfloat16):
    inp = probe._inputs(3, 2, 4, dtype, "cpu", pool_bytes=0)
    mixed, a, b, A_log, dt_bias, pool, slots = inp
    ref_pool = pool.clone()
    want = gdn.gdn_decode_fused.backends["reference"].fn(mixed, a, b, A_log, dt_bias, ref_pool, slots, 2,
                                                         probe.DK ** -0.5, 1e-6)
    for bv in (32, 64, 128):
        run_inp = inp[:5] + (pool.clone(), slots)
        run, o = probe._launch(run_inp, 2, bv, 4)
        run(None)
        out.append([str(dtype), bv, (o.float() - want.float()).abs().max().item(),
                    (run_inp[5].float() - ref_pool.float()).abs().max().item()])
print(json.dumps(out))
"""


def test_probe_launches_match_the_reference():
    got = run_interpreted(_SCRIPT)
    assert len(got) == 6
    for dtype, bv, d_out, d_state in got:
        assert d_out < 0.02 and d_state < 0.02, (dtype, bv, d_out, d_state)

