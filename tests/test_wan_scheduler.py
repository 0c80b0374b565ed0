"""mstar.models.wan.scheduler (FlowUniPCScheduler) against diffusers' UniPCMultistepScheduler.

Tolerance: none. Both compute the same torch operations in the same order and dtypes (0-d float32 CPU
coefficients against the sample, no upcast), on CPU kernels that are deterministic, so the schedules
and every sample of a loop are compared bit for bit (torch.equal), in float32 and bfloat16.
"""

from __future__ import annotations

import json

import pytest
import torch

from mstar.models.wan.scheduler import WAN22_TI2V_5B_SCHEDULER, FlowUniPCScheduler

diffusers = pytest.importorskip("diffusers")
UniPCMultistepScheduler = diffusers.UniPCMultistepScheduler

SHAPE = (2, 4, 3, 4, 4)  # [B, C, F, H, W], a Wan latent's layout


def _theirs(cfg: dict, n: int, shift: float | None = None):
    kw = {} if shift is None else {"flow_shift": shift}
    s = UniPCMultistepScheduler.from_config(cfg, **kw)
    s.set_timesteps(n, device="cpu")
    return s


def _fake_model(sample: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, dtype) -> torch.Tensor:
    # deterministic in (sample, t) plus a fresh random draw per step
    return (torch.tanh(sample.float()) * (t.float() / 1000) + noise).to(dtype)


def _noises(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


def _x_init(dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _run_ours(sched, n, shift, sample_dtype, out_dtype, seed=0):
    st = sched.new_state(n, flow_shift=shift)
    x = _x_init(sample_dtype)
    outs = []
    for noise in _noises(n, seed):
        x = sched.step(st, _fake_model(x, st.timestep, noise, out_dtype), x)
        outs.append(x)
    assert st.done and st.step_index == n
    return outs


def _run_theirs(cfg, n, shift, sample_dtype, out_dtype, seed=0):
    s = _theirs(cfg, n, shift)
    x = _x_init(sample_dtype)
    outs = []
    for t, noise in zip(s.timesteps, _noises(n, seed)):  # as WanPipeline calls it
        x = s.step(_fake_model(x, t, noise, out_dtype), t, x, return_dict=False)[0]
        outs.append(x)
    return outs


def _assert_same(ours, theirs, upto=None):
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(list(zip(ours, theirs))[:upto]):
        assert a.dtype == b.dtype, k
        assert torch.equal(a, b), f"step {k}: max |diff| {(a.float() - b.float()).abs().max().item()}"


# ------------------------------------------------------------------ schedule

@pytest.mark.parametrize("n", [1, 2, 3, 10, 50])
@pytest.mark.parametrize("shift", [3.0, 5.0, 12.0])
def test_schedule_matches_diffusers(n, shift):
    ours = FlowUniPCScheduler(WAN22_TI2V_5B_SCHEDULER).new_state(n, flow_shift=shift)
    theirs = _theirs(WAN22_TI2V_5B_SCHEDULER, n, shift)
    assert ours.timesteps.dtype == theirs.timesteps.dtype == torch.int64
    assert torch.equal(ours.timesteps, theirs.timesteps)
    assert ours.sigmas.dtype == theirs.sigmas.dtype == torch.float32
    assert torch.equal(ours.sigmas, theirs.sigmas)
    assert ours.sigmas.shape == (n + 1,) and ours.sigmas[-1] == 0


def test_schedule_sigma_min_and_config_shift():
    cfg = {**WAN22_TI2V_5B_SCHEDULER, "final_sigmas_type": "sigma_min", "num_train_timesteps": 500}
    ours = FlowUniPCScheduler(cfg).new_state(7)  # the config's flow_shift (5.0)
    theirs = _theirs(cfg, 7)
    assert torch.equal(ours.timesteps, theirs.timesteps) and torch.equal(ours.sigmas, theirs.sigmas)
    assert ours.flow_shift == 5.0 and ours.sigmas[-1] == ours.sigmas[-2]


# ------------------------------------------------------------------ whole loops

DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.bfloat16)]  # the last: WanPipeline's float32 latents, bf16 transformer output


@pytest.mark.parametrize("n", [1, 3, 10, 50])
@pytest.mark.parametrize("dtypes", DTYPES, ids=["f32", "bf16", "f32-sample-bf16-out"])
def test_loop_matches_diffusers_wan_config(n, dtypes):
    sched = FlowUniPCScheduler(WAN22_TI2V_5B_SCHEDULER)
    _assert_same(_run_ours(sched, n, 5.0, *dtypes), _run_theirs(WAN22_TI2V_5B_SCHEDULER, n, 5.0, *dtypes))


VARIANTS = {
    "shift3": ({}, 3.0),
    "shift12": ({}, 12.0),
    "order3": ({"solver_order": 3}, 5.0),
    "order1": ({"solver_order": 1}, 5.0),
    "bh1-sigma_min": ({"solver_type": "bh1", "final_sigmas_type": "sigma_min"}, 5.0),
    "no-lower-order-final": ({"lower_order_final": False, "final_sigmas_type": "sigma_min"}, 5.0),
    "disable-corrector": ({"disable_corrector": [0, 3]}, 5.0),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_loop_matches_diffusers_variants(name, dtype):
    over, shift = VARIANTS[name]
    cfg = {**WAN22_TI2V_5B_SCHEDULER, **over}
    sched = FlowUniPCScheduler(cfg)
    _assert_same(_run_ours(sched, 12, shift, dtype, dtype), _run_theirs(cfg, 12, shift, dtype, dtype))


def test_bh1_zero_final_sigma_is_finite_where_diffusers_is_nan():
    cfg = {**WAN22_TI2V_5B_SCHEDULER, "solver_type": "bh1"}
    ours = _run_ours(FlowUniPCScheduler(cfg), 8, 5.0, torch.float32, torch.float32)
    theirs = _run_theirs(cfg, 8, 5.0, torch.float32, torch.float32)
    _assert_same(ours[:-1], theirs[:-1])
    assert torch.isnan(theirs[-1]).all() and torch.isfinite(ours[-1]).all()


def test_repeated_first_timestep_starts_at_step_zero():
    # flow_shift 12, 100 steps: int64 truncation gives timesteps 999, 999, ...; diffusers would look the
    # first one up and start at its second occurrence, so compare with its begin index set to 0
    s = _theirs(WAN22_TI2V_5B_SCHEDULER, 100, 12.0)
    assert s.timesteps[0] == s.timesteps[1]
    s.set_begin_index(0)
    sched = FlowUniPCScheduler(WAN22_TI2V_5B_SCHEDULER)
    st = sched.new_state(100, flow_shift=12.0)
    x = y = _x_init(torch.float32)
    for t, noise in zip(s.timesteps, _noises(100)):
        assert st.timestep == t
        x = sched.step(st, _fake_model(x, t, noise, torch.float32), x)
        y = s.step(_fake_model(y, t, noise, torch.float32), t, y, return_dict=False)[0]
        assert torch.equal(x, y)


def test_exact_flow_lands_on_the_data():
    # with the exact velocity of a straight path (noise - x0), every step stays on the path: the end is x0
    sched = FlowUniPCScheduler()
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(SHAPE, generator=g, dtype=torch.float64), torch.randn(SHAPE, generator=g,
                                                                                  dtype=torch.float64)
    st = sched.new_state(10)
    s0 = st.sigmas[0].double()
    x = (1 - s0) * x0 + s0 * noise  # sigma_0 is 0.9998, not 1
    while not st.done:
        x = sched.step(st, noise - x0, x)
        s = st.sigmas[st.step_index].double()
        assert torch.allclose(x, (1 - s) * x0 + s * noise, atol=1e-5)  # float32 coefficients
    assert torch.allclose(x, x0, atol=1e-5)


# ------------------------------------------------------------------ independent states

def test_interleaved_states_match_each_alone():
    sched = FlowUniPCScheduler(WAN22_TI2V_5B_SCHEDULER)
    na, nb = 10, 7
    alone_a = _run_ours(sched, na, 5.0, torch.float32, torch.float32, seed=0)
    alone_b = _run_ours(sched, nb, 3.0, torch.float32, torch.float32, seed=5)

    a, b = sched.new_state(na, flow_shift=5.0), sched.new_state(nb, flow_shift=3.0)
    xa, xb = _x_init(torch.float32), _x_init(torch.float32)
    noise_a, noise_b = _noises(na, 0), _noises(nb, 5)
    got_a, got_b = [], []
    for _ in range(3):  # A runs alone to step 3, then B joins at its step 0
        xa = sched.step(a, _fake_model(xa, a.timestep, noise_a[a.step_index], torch.float32), xa)
        got_a.append(xa)
    while not (a.done and b.done):
        # one shared denoise batch: both requests' rows in one model call, each at its own timestep
        live = [s for s in (a, b) if not s.done]
        xs = torch.cat([xa if s is a else xb for s in live])
        ts = torch.cat([s.timestep.expand(SHAPE[0]) for s in live]).view(-1, 1, 1, 1, 1)
        nz = torch.cat([(noise_a if s is a else noise_b)[s.step_index] for s in live])
        outs = _fake_model(xs, ts, nz, torch.float32).split(SHAPE[0])
        for s, v in zip(live, outs):
            if s is a:
                xa = sched.step(a, v, xa)
                got_a.append(xa)
            else:
                xb = sched.step(b, v, xb)
                got_b.append(xb)
    _assert_same(got_a, alone_a)
    _assert_same(got_b, alone_b)


def test_batch_rows_are_independent():
    sched = FlowUniPCScheduler(WAN22_TI2V_5B_SCHEDULER)
    n = 6
    st = sched.new_state(n)
    rows = [sched.new_state(n) for _ in range(SHAPE[0])]
    x = _x_init(torch.bfloat16)
    xr = list(x.split(1))
    for noise in _noises(n):
        v = _fake_model(x, st.timestep, noise, torch.bfloat16)
        x = sched.step(st, v, x)
        xr = [sched.step(r, vr, xi) for r, vr, xi in zip(rows, v.split(1), xr)]
        assert torch.equal(x, torch.cat(xr))


# ------------------------------------------------------------------ config

def test_default_and_from_dir(tmp_path):
    assert FlowUniPCScheduler().config == FlowUniPCScheduler(WAN22_TI2V_5B_SCHEDULER).config
    (tmp_path / "scheduler").mkdir()
    cfg = {**WAN22_TI2V_5B_SCHEDULER, "flow_shift": 3.0, "_diffusers_version": "0.35.0.dev0", "extra_key": 7}
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(cfg))
    for path in (tmp_path / "scheduler", tmp_path):
        s = FlowUniPCScheduler.from_dir(str(path))
        assert s.flow_shift == 3.0 and s.config["extra_key"] == 7
    # keys left out take diffusers' defaults
    minimal = FlowUniPCScheduler({"prediction_type": "flow_prediction", "use_flow_sigmas": True})
    assert minimal.flow_shift == 1.0 and minimal.solver_order == 2 and minimal.solver_type == "bh2"


REFUSED = [
    ("prediction_type", "epsilon"),
    ("prediction_type", "v_prediction"),
    ("use_flow_sigmas", False),
    ("solver_type", "dpmsolver++"),
    ("thresholding", True),
    ("predict_x0", False),
    ("use_karras_sigmas", True),
    ("use_exponential_sigmas", True),
    ("use_beta_sigmas", True),
    ("solver_p", {"_class_name": "DPMSolverMultistepScheduler"}),
    ("final_sigmas_type", "sigma_max"),
    ("timestep_spacing", "random"),
    ("solver_order", 0),
    ("flow_shift", -1.0),
    ("_class_name", "FlowMatchEulerDiscreteScheduler"),
    ("lower_order_final", False),  # with final_sigmas_type "zero": diffusers returns inf
]


@pytest.mark.parametrize("key,value", REFUSED, ids=[f"{k}={v}" for k, v in REFUSED])
def test_refuses_what_it_does_not_implement(key, value):
    with pytest.raises(ValueError, match=key):
        FlowUniPCScheduler({**WAN22_TI2V_5B_SCHEDULER, key: value})


def test_refuses_bad_calls():
    sched = FlowUniPCScheduler()
    with pytest.raises(ValueError, match="num_inference_steps"):
        sched.new_state(0)
    with pytest.raises(ValueError, match="flow_shift"):
        sched.new_state(4, flow_shift=0.0)
    st = sched.new_state(1)
    x = torch.zeros(SHAPE)
    sched.step(st, x, x)
    with pytest.raises(IndexError):
        sched.step(st, x, x)
    with pytest.raises(ValueError, match="solver_order"):
        FlowUniPCScheduler({**WAN22_TI2V_5B_SCHEDULER, "solver_order": 3}).step(sched.new_state(2), x, x)
