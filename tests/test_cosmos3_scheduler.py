"""The flow sigma schedules diffusers >= 0.40 computes (mstar.models.wan.scheduler: flow_sigmas,
FlowUniPCScheduler(flow_sigmas=...)) against diffusers 0.42.1's UniPCMultistepScheduler, run in the
cached "diffusers-0.42" environment:

    "native"          what Cosmos3OmniPipeline with use_native_flow_schedule (the Cosmos3-Edge
                      release) passes: set_timesteps(sigmas=linspace(1 - 1/T, 0, N + 1)[:-1])
    "diffusers-0.40"  set_timesteps(N) with no sigmas (a Cosmos3 checkpoint without the flag)

Tolerance: none. The schedules (timesteps, sigmas) and every sample of a UniPC loop (float32 and
bfloat16, the Cosmos3 pipeline's call: float32 latents, a model output) are compared bit for bit.
The Wan schedule (diffusers 0.36's, the default) is tested against 0.36 in test_wan_scheduler.py;
here it is shown to differ from both newer ones.
"""

from __future__ import annotations

import pytest
import torch

from mstar.models.cosmos3.presets import COSMOS3_EDGE_SCHEDULER
from mstar.models.wan.scheduler import (FLOW_SIGMAS_DIFFUSERS, FLOW_SIGMAS_NATIVE, FLOW_SIGMAS_WAN,
                                        FlowUniPCScheduler, flow_sigmas)
from reference_envs import reference_env, run_reference

STEPS = (1, 2, 3, 10, 35, 50)
SHIFTS = (1.0, 3.0, 5.0, 12.0)
KINDS = (FLOW_SIGMAS_NATIVE, FLOW_SIGMAS_DIFFUSERS)
LOOPS = [(FLOW_SIGMAS_NATIVE, 50, 3.0, "float32"), (FLOW_SIGMAS_NATIVE, 12, 5.0, "bfloat16"),
         (FLOW_SIGMAS_DIFFUSERS, 35, 5.0, "float32"), (FLOW_SIGMAS_DIFFUSERS, 7, 12.0, "bfloat16")]
SHAPE = (1, 8, 2, 4, 4)

SCRIPT = r'''
import numpy as np
from diffusers import UniPCMultistepScheduler

def make(kind, n, shift):
    s = UniPCMultistepScheduler.from_config(ARGS["config"], flow_shift=shift)
    if kind == "native":  # Cosmos3OmniPipeline with use_native_flow_schedule
        T = s.config.num_train_timesteps
        s.set_timesteps(n, device="cpu", sigmas=np.linspace(1.0 - 1.0 / T, 0.0, n + 1)[:-1])
    else:
        s.set_timesteps(n, device="cpu")
    return s

RESULT = {"schedules": {}, "loops": []}
for kind in ARGS["kinds"]:
    for n in ARGS["steps"]:
        for shift in ARGS["shifts"]:
            s = make(kind, n, shift)
            RESULT["schedules"][f"{kind}/{n}/{shift}"] = (s.timesteps.clone(), s.sigmas.clone())
for kind, n, shift, dtype in ARGS["loops"]:
    s = make(kind, n, shift)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ARGS["shape"], generator=g)
    outs = []
    for t in s.timesteps:
        v = (torch.tanh(x) * (t.float() / 1000) + torch.randn(ARGS["shape"], generator=g)).to(dt)
        x = s.step(v.float(), t, x, return_dict=False)[0]  # the pipeline's float32 velocity and latents
        outs.append(x)
    RESULT["loops"].append(outs)
'''


@pytest.fixture(scope="module")
def ref():
    cfg = {k: v for k, v in COSMOS3_EDGE_SCHEDULER.items() if not k.startswith("_")}
    return run_reference(reference_env("diffusers-0.42"), SCRIPT,
                         {"config": cfg, "kinds": list(KINDS), "steps": list(STEPS), "shifts": list(SHIFTS),
                          "loops": [list(x) for x in LOOPS], "shape": list(SHAPE)})


@pytest.mark.parametrize("kind", KINDS)
def test_schedules_match_diffusers_042(ref, kind):
    sched = FlowUniPCScheduler(COSMOS3_EDGE_SCHEDULER, flow_sigmas=kind)
    for n in STEPS:
        for shift in SHIFTS:
            ts, sig = ref["schedules"][f"{kind}/{n}/{shift}"]
            st = sched.new_state(n, flow_shift=shift)
            assert st.timesteps.dtype == ts.dtype == torch.int64 and st.sigmas.dtype == sig.dtype == torch.float32
            assert torch.equal(st.timesteps, ts), (n, shift, st.timesteps, ts)
            assert torch.equal(st.sigmas, sig), (n, shift)


@pytest.mark.parametrize("case", range(len(LOOPS)))
def test_loops_match_diffusers_042(ref, case):
    kind, n, shift, dtype = LOOPS[case]
    dt = getattr(torch, dtype)
    sched = FlowUniPCScheduler(COSMOS3_EDGE_SCHEDULER, flow_sigmas=kind)
    st = sched.new_state(n, flow_shift=shift)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g)
    for k, want in enumerate(ref["loops"][case]):
        v = (torch.tanh(x) * (st.timestep.float() / 1000) + torch.randn(SHAPE, generator=g)).to(dt)
        x = sched.step(st, v.float(), x)
        assert torch.equal(x, want), f"step {k}: max |diff| {(x - want).abs().max().item()}"
    assert st.done


def test_what_differs_from_the_wan_schedule():
    """Per unshifted u, diffusers 0.36: (1 - 1/T) k / N, k = N .. 1; >= 0.40's default: that + 1/T,
    its first (1 before the shift) lowered by 1e-6; native: the 0.36 values, computed another way."""
    n, big_t = 3, 1000
    wan, new, native = (flow_sigmas(n, 1.0, big_t, k) for k in (FLOW_SIGMAS_WAN, FLOW_SIGMAS_DIFFUSERS,
                                                                  FLOW_SIGMAS_NATIVE))
    assert wan[0] == 0.999 and new[0] == 1 - 1e-6 and abs(new[1] - (wan[1] + 1 / big_t)) < 1e-12
    assert abs(native - wan).max() < 1e-15 and not (native == wan).all()
    ts = [FlowUniPCScheduler(COSMOS3_EDGE_SCHEDULER, flow_sigmas=k).new_state(n, flow_shift=1.0).timesteps.tolist()
          for k in (FLOW_SIGMAS_WAN, FLOW_SIGMAS_NATIVE, FLOW_SIGMAS_DIFFUSERS)]
    assert ts == [[999, 666, 332], [999, 665, 332], [999, 667, 333]], ts
    assert FlowUniPCScheduler(COSMOS3_EDGE_SCHEDULER).flow_sigmas == FLOW_SIGMAS_WAN  # Wan's configs: unchanged
    with pytest.raises(ValueError, match="flow_sigmas"):
        FlowUniPCScheduler(COSMOS3_EDGE_SCHEDULER, flow_sigmas="karras")
    with pytest.raises(ValueError, match="shift_terminal"):
        FlowUniPCScheduler({**COSMOS3_EDGE_SCHEDULER, "shift_terminal": 0.1}, flow_sigmas=FLOW_SIGMAS_NATIVE)
