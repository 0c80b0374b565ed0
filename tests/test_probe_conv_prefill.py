"""The launches `python -m mstar.bench.tools.probe_conv_prefill` times compute the op's prefill
(Triton's CPU interpreter) at several token / channel blocks and warps, from a column view of a
wider projection as the model passes it, against the op's reference."""

from __future__ import annotations

from triton_interpreter import run_interpreted

_SCRIPT = r"""
import json, torch
from mstar.bench.tools import probe_conv_prefill as probe
from mstar.ops import conv1d
torch.manual_seed(int(torch.randint(1 << 30, ())))
x, w, pool, cu, slots, none = probe.inputs(3, 20, 40, 56, "cpu", slots_n=5)
ref_pool = pool.clone()
want = conv1d.causal_conv1d_prefill.backends["reference"].fn(x, w, None, ref_pool, cu, slots, none, none, True)
out = []
for cfg in ((16, 32, 4), (32, 64, 8), (64, 16, 2)):
    p = pool.clone()
    got = probe.run_with(cfg, (x, w, p, cu, slots, none))
    d_out = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    out.append([list(cfg), d_out, (p.float() - ref_pool.float()).abs().max().item()])
print(json.dumps(out))
"""


def test_probe_launches_match_the_reference():
    got = run_interpreted(_SCRIPT)
    assert len(got) == 3
    for cfg, d_out, d_pool in got:
        assert d_out <= 2.0 ** -7 and d_pool == 0.0, (cfg, d_out, d_pool)
