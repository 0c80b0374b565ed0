"""The flow-matching UniPC multistep sampler of the Wan2.2 diffusers pipelines.

Wan2.2's diffusers pipelines (WanPipeline, TI2V-5B) sample with diffusers' UniPCMultistepScheduler
configured for flow matching (scheduler/scheduler_config.json: prediction_type "flow_prediction",
use_flow_sigmas true, flow_shift 5.0, solver_order 2, solver_type "bh2", predict_x0, lower_order_final,
final_sigmas_type "zero"). This module computes the same schedule and the same steps, with the
per-request state (step index, the last model outputs, the last sample) kept out of the scheduler
so that requests at different steps share one scheduler, and their rows one denoise batch:

    sched = FlowUniPCScheduler.from_dir("<model>/scheduler")
    state = sched.new_state(50, flow_shift=5.0, device="cuda")
    while not state.done:
        v = model(latents, timestep=state.timestep)           # the flow (velocity) prediction
        latents = sched.step(state, v, latents)               # advances state.step_index

The schedule (diffusers' set_timesteps with use_flow_sigmas): with T = num_train_timesteps and N steps,
u = 1 - linspace(1, 1/T, N + 1) (float64); the shifted s = shift * u / (1 + (shift - 1) * u), reversed,
its last (zero) entry dropped, gives N sigmas from ~1 down; the timesteps are int64(sigma * T) (diffusers
truncates them to int64 too); the sigmas get a final 0 ("zero") or a repeat of the last one ("sigma_min")
and are float32 on the CPU.

That is diffusers 0.36's flow schedule (FLOW_SIGMAS_WAN, the default). diffusers 0.40 changed it;
a scheduler built with `flow_sigmas=` computes one of the newer ones instead (the steps are the
same; only the N sigmas, hence the timesteps, differ):
  FLOW_SIGMAS_DIFFUSERS  diffusers >= 0.40's set_timesteps with no sigmas given: the unshifted
                         u = linspace(1, 1/T, N + 1)[:N] (the 0.36 values + 1/T), shifted, and a
                         first sigma within 1e-6 of 1 lowered by 1e-6 (so the first timestep is
                         999, not 1000, and log(1 - sigma) stays finite).
  FLOW_SIGMAS_NATIVE     the sigmas a pipeline passes to that set_timesteps for the "native" flow
                         schedule (Cosmos3OmniPipeline with use_native_flow_schedule, the
                         Cosmos3-Edge release): u = linspace(1 - 1/T, 0, N + 1)[:N], shifted (the
                         same check of the first sigma). These are the 0.36 values in exact
                         arithmetic, computed another way: a sigma's last bit, and a timestep's
                         int64 truncation, can differ (N = 3, shift 1: timesteps 999, 665, 332
                         against 0.36's 999, 666, 332).

A step at index i (alpha = 1 - sigma, lambda = log(alpha) - log(sigma), h = lambda_next - lambda_i):
  1. x0 = sample - sigma_i * model_output  (the data prediction).
  2. From i >= 1 (unless i - 1 is in disable_corrector) the UniC corrector refines the sample this
     model output was computed from, using x0 (the model output is not recomputed: UniPC's trick).
  3. The UniP predictor of order p goes to sigma_{i+1}: p = solver_order, limited by the history so far
     (1 at the first step, 2 at the second, ...) and, with lower_order_final, by the steps left.
  B(h) is -h ("bh1") or expm1(-h) ("bh2"); the order-2 predictor's weight is 0.5, higher orders solve
  the small Vandermonde system of the lambda ratios (as diffusers does, in float32 on the CPU).

The arithmetic follows diffusers' operations and dtypes one for one (0-d float32 CPU coefficients
against the sample; no upcast of the sample: a bfloat16 sample is stepped in bfloat16, a float32 one
in float32, as diffusers 0.36 does), so the samples match bit for bit. Differences on purpose:
  - A state always starts at its first timestep. diffusers looks the first timestep up in its list
    and, when it occurs twice (int64 truncation: flow_shift 12 at 89+ steps, say), starts at the
    second occurrence and fails at the end; this matches diffusers with set_begin_index(0).
  - With "bh1" and a final sigma of zero, diffusers' last predictor step computes (-inf) * 0 = NaN;
    here a first-order step adds no higher-order term, so the last sample is the x0 prediction (the
    finite limit). Elsewhere the results are the same bits ("bh2", Wan's choice, is unaffected).
  - lower_order_final false with a zero final sigma and solver_order > 1 is refused: the last step's
    higher-order term divides by a zero lambda ratio (diffusers returns inf / NaN).

A state belongs to one request, or to one batch of requests that started together with the same
step count and shift (rows are independent: every operation is elementwise or per row).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
import numpy as np
import torch

from mstar.models.host_copy import to_device
from mstar.models.wan.scheduler_config import (CLASS_NAME, CONFIG_FILE, DIFFUSERS_DEFAULTS, FLOW_SIGMAS,
                                               FLOW_SIGMAS_DIFFUSERS, FLOW_SIGMAS_NATIVE, FLOW_SIGMAS_WAN,
                                               WAN22_TI2V_5B_SCHEDULER)

# solver_type names diffusers accepts and runs as "bh2"
_BH2_ALIASES = ("midpoint", "heun", "logrho")

_FIRST_SIGMA_EPS = 1e-6  # diffusers >= 0.40 lowers a first sigma this close to 1 by this much


def flow_sigmas(n: int, shift: float, num_train_timesteps: int, kind: str = FLOW_SIGMAS_WAN) -> np.ndarray:
    """The N shifted flow sigmas (float64, high noise first, no final sigma) of schedule `kind`,
    with diffusers' numpy operations of that schedule."""
    big_t = num_train_timesteps
    if kind == FLOW_SIGMAS_WAN:
        u = 1.0 - np.linspace(1.0, 1.0 / big_t, n + 1)                # 0 .. 1 - 1/T
        return (shift * u / (1.0 + (shift - 1.0) * u))[::-1][:n].copy()  # reversed, the 0 dropped
    if kind == FLOW_SIGMAS_DIFFUSERS:
        u = np.linspace(1.0, 1.0 / big_t, n + 1)[:-1]
    elif kind == FLOW_SIGMAS_NATIVE:
        u = np.linspace(1.0 - 1.0 / big_t, 0.0, n + 1)[:-1]
    else:
        raise ValueError(f"flow_sigmas must be one of {', '.join(FLOW_SIGMAS)}, got {kind!r}")
    s = shift * u / (1 + (shift - 1) * u)
    if np.fabs(s[0] - 1) < _FIRST_SIGMA_EPS:
        s[0] -= _FIRST_SIGMA_EPS
    return s


@dataclass
class UniPCState:
    """One request's (or one same-start batch's) place in the schedule and its multistep history.

    timesteps  [N] int64 on the state's device (what diffusers' set_timesteps gives)
    sigmas     [N + 1] float32 on the CPU (the last one 0 for final_sigmas_type "zero")
    step_index the next step to take (0 .. N; N = done)
    model_outputs  the last solver_order data predictions (oldest first; None before they exist)
    last_sample    the sample the last predictor step started from (the corrector's input)
    """

    timesteps: torch.Tensor
    sigmas: torch.Tensor
    flow_shift: float
    step_index: int = 0
    model_outputs: list[torch.Tensor | None] = field(default_factory=list)
    last_sample: torch.Tensor | None = None
    lower_order_nums: int = 0
    this_order: int = 0

    @property
    def num_inference_steps(self) -> int:
        return int(self.timesteps.shape[0])

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_inference_steps

    @property
    def timestep(self) -> torch.Tensor:
        """The timestep to give the model at the current step (0-d int64, on the state's device)."""
        if self.done:
            raise IndexError(f"the schedule is done ({self.num_inference_steps} steps)")
        return self.timesteps[self.step_index]

    @property
    def sigma(self) -> float:
        """The current noise level (the sample is (1 - sigma) * x0 + sigma * noise)."""
        return float(self.sigmas[min(self.step_index, self.num_inference_steps)])


def _flag(cfg: dict, key: str) -> bool:
    v = cfg[key]
    if v is None:
        return False
    if not isinstance(v, (bool, int)):
        raise ValueError(f"scheduler config: {key!r} must be a boolean, got {v!r}")
    return bool(v)


class FlowUniPCScheduler:
    """diffusers' UniPCMultistepScheduler for flow matching, stateless: the state is a UniPCState."""

    def __init__(self, config: dict | None = None, flow_sigmas: str = FLOW_SIGMAS_WAN):
        """flow_sigmas: which diffusers flow schedule the sigmas follow (module docstring)."""
        given = dict(WAN22_TI2V_5B_SCHEDULER if config is None else config)
        cfg = {**DIFFUSERS_DEFAULTS, **given}  # unknown keys are kept (and not used)
        self._check(cfg)
        if flow_sigmas not in FLOW_SIGMAS:
            raise ValueError(f"flow_sigmas must be one of {', '.join(FLOW_SIGMAS)}, got {flow_sigmas!r}")
        if flow_sigmas != FLOW_SIGMAS_WAN:
            for key in ("shift_terminal", "sigma_min", "sigma_max"):  # diffusers >= 0.40's, unused at 0.36
                if cfg.get(key) is not None:
                    raise ValueError(f"scheduler config: {key!r} is not supported")
        self.flow_sigmas = flow_sigmas
        if cfg["solver_type"] in _BH2_ALIASES:
            cfg["solver_type"] = "bh2"  # as diffusers registers it
        self.config = cfg
        self.num_train_timesteps = int(cfg["num_train_timesteps"])
        self.solver_order = int(cfg["solver_order"])
        self.solver_type = cfg["solver_type"]
        self.lower_order_final = _flag(cfg, "lower_order_final")
        self.final_sigmas_type = cfg["final_sigmas_type"]
        self.flow_shift = float(cfg["flow_shift"])
        self.disable_corrector = frozenset(int(i) for i in (cfg["disable_corrector"] or ()))

    @classmethod
    def from_dir(cls, path, flow_sigmas: str = FLOW_SIGMAS_WAN) -> "FlowUniPCScheduler":
        """Read <path>/scheduler_config.json (or <path>/scheduler/scheduler_config.json, a model root)."""
        file = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(file):
            nested = os.path.join(path, "scheduler", CONFIG_FILE)
            if os.path.isfile(nested):
                file = nested
        with open(file, encoding="utf-8") as f:
            return cls(json.load(f), flow_sigmas=flow_sigmas)

    # ---------------------------------------------------------------- config

    @staticmethod
    def _check(cfg: dict) -> None:
        name = cfg.get("_class_name")
        if name is not None and name != CLASS_NAME:
            raise ValueError(f"scheduler config: '_class_name' {name!r} is not {CLASS_NAME}")
        if cfg["prediction_type"] != "flow_prediction":
            raise ValueError(f"scheduler config: 'prediction_type' {cfg['prediction_type']!r} is not supported "
                             "(only 'flow_prediction')")
        if not _flag(cfg, "use_flow_sigmas"):
            raise ValueError("scheduler config: 'use_flow_sigmas' must be true (only the flow-matching schedule)")
        for key in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas"):
            if _flag(cfg, key):  # diffusers lets each of these override the flow sigmas
                raise ValueError(f"scheduler config: {key!r} is not supported")
        if not _flag(cfg, "predict_x0"):
            raise ValueError("scheduler config: 'predict_x0' false is not supported (diffusers has no flow "
                             "prediction for it either)")
        if _flag(cfg, "thresholding"):
            raise ValueError("scheduler config: 'thresholding' is not supported")
        if cfg["solver_p"] is not None:
            raise ValueError("scheduler config: 'solver_p' is not supported")
        if cfg["solver_type"] not in ("bh1", "bh2", *_BH2_ALIASES):
            raise ValueError(f"scheduler config: 'solver_type' {cfg['solver_type']!r} is not supported "
                             "(bh1 or bh2)")
        order = cfg["solver_order"]
        if isinstance(order, bool) or not isinstance(order, int) or order < 1:
            raise ValueError(f"scheduler config: 'solver_order' must be a positive integer, got {order!r}")
        t = cfg["num_train_timesteps"]
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"scheduler config: 'num_train_timesteps' must be a positive integer, got {t!r}")
        if cfg["final_sigmas_type"] not in ("zero", "sigma_min"):
            raise ValueError(f"scheduler config: 'final_sigmas_type' {cfg['final_sigmas_type']!r} is not "
                             "supported ('zero' or 'sigma_min')")
        if cfg["timestep_spacing"] not in ("linspace", "leading", "trailing"):
            # unused by the flow schedule, but diffusers refuses other values
            raise ValueError(f"scheduler config: 'timestep_spacing' {cfg['timestep_spacing']!r} is not supported")
        shift = cfg["flow_shift"]
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not shift > 0:
            raise ValueError(f"scheduler config: 'flow_shift' must be a positive number, got {shift!r}")
        if (not _flag(cfg, "lower_order_final") and cfg["final_sigmas_type"] == "zero"
                and order > 1):
            raise ValueError("scheduler config: 'lower_order_final' false with final_sigmas_type 'zero' and "
                             "solver_order > 1 is not supported (the last step divides by zero; diffusers "
                             "returns inf / NaN)")
        dc = cfg["disable_corrector"]
        if dc is not None and (not isinstance(dc, (list, tuple))
                               or any(isinstance(i, bool) or not isinstance(i, int) for i in dc)):
            raise ValueError(f"scheduler config: 'disable_corrector' must be a list of step indices, got {dc!r}")

    # ---------------------------------------------------------------- schedule

    def schedule(self, num_inference_steps: int, flow_shift: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps [N] int64, sigmas [N + 1] float32), both on the CPU."""
        n = num_inference_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_inference_steps must be a positive integer, got {n!r}")
        shift = self.flow_shift if flow_shift is None else float(flow_shift)
        if not (shift > 0 and math.isfinite(shift)):
            raise ValueError(f"flow_shift must be a positive number, got {flow_shift!r}")
        big_t = self.num_train_timesteps
        if self.flow_sigmas == FLOW_SIGMAS_WAN:
            u = 1.0 - np.linspace(1.0, 1.0 / big_t, n + 1)                 # 0 .. 1 - 1/T, float64
            shifted = shift * u / (1.0 + (shift - 1.0) * u)
            s = shifted[::-1][:n].copy()                                   # high noise first, the 0 dropped
        else:
            s = flow_sigmas(n, shift, big_t, self.flow_sigmas)             # diffusers >= 0.40's
        ts = torch.from_numpy(s * big_t).to(torch.int64)               # truncated, as diffusers does
        last = 0.0 if self.final_sigmas_type == "zero" else s[-1]
        sig = torch.from_numpy(np.append(s, last).astype(np.float32))
        return ts, sig

    @staticmethod
    def current_timesteps(states: list[UniPCState], dtype: torch.dtype, device) -> torch.Tensor:
        """The states' current timesteps as one [len(states)] tensor of `dtype` on `device` (from
        states on the CPU, their default), copied without a host sync (models/host_copy.py)."""
        return to_device(torch.stack([s.timestep for s in states]).to(dtype), device)

    def new_state(self, num_inference_steps: int, flow_shift: float | None = None, device="cpu") -> UniPCState:
        """A fresh state at step 0 of an N-step schedule (flow_shift None: the config's)."""
        ts, sig = self.schedule(num_inference_steps, flow_shift)
        shift = self.flow_shift if flow_shift is None else float(flow_shift)
        return UniPCState(timesteps=ts.to(device), sigmas=sig, flow_shift=shift,
                          model_outputs=[None] * self.solver_order)

    # ---------------------------------------------------------------- stepping

    @staticmethod
    def _lam(sigma: torch.Tensor) -> torch.Tensor:
        # flow sigmas: alpha = 1 - sigma; lambda = log(alpha / sigma), as two logs (+inf at sigma 0)
        return torch.log(1 - sigma) - torch.log(sigma)

    def _bh_terms(self, sigmas: torch.Tensor, t: int, s0: int, history: list[int], order: int):
        """The B(h) terms of one update from sigma[s0] to sigma[t], the earlier points at `history`
        (sigma indices, newest first, order - 1 of them): (alpha_t, sigma ratio, expm1(-h), B(h), the
        lambda ratios r_k, the Vandermonde matrix R and the right side b)."""
        sig_t, sig_s0 = sigmas[t], sigmas[s0]
        alpha_t = 1 - sig_t
        lam_s0 = self._lam(sig_s0)
        h = self._lam(sig_t) - lam_s0
        ratios = [(self._lam(sigmas[j]) - lam_s0) / h for j in history]
        rk = torch.stack([*ratios, torch.ones((), dtype=h.dtype)])
        hh = -h                                                       # predict_x0
        h_phi_1 = torch.expm1(hh)
        b_h = hh if self.solver_type == "bh1" else torch.expm1(hh)
        rows, rhs = [], []
        h_phi_k = h_phi_1 / hh - 1
        fact = 1
        for k in range(1, order + 1):
            rows.append(torch.pow(rk, k - 1))
            rhs.append(h_phi_k * fact / b_h)
            fact *= k + 1
            h_phi_k = h_phi_k / hh - 1 / fact
        return alpha_t, sig_t / sig_s0, h_phi_1, b_h, ratios, torch.stack(rows), torch.stack(rhs)

    @staticmethod
    def _weighted(rhos: list[float], diffs: list[torch.Tensor]) -> torch.Tensor:
        # sum_k rho_k * D_k; the coefficients are host numbers (no device tensor made, no host sync),
        # summed in float32 and rounded once, as the einsum over the stacked differences does
        if len(rhos) == 1:
            return diffs[0] * rhos[0]
        out = diffs[0].float() * rhos[0]
        for rho, d in zip(rhos[1:], diffs[1:]):
            out = out.add(d.float(), alpha=rho)
        return out.to(diffs[0].dtype)

    @staticmethod
    def _rhos(big_r: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> list[float]:
        """The solver's coefficients, solved on the host and rounded to the sample's dtype."""
        return torch.linalg.solve(big_r, b).to(dtype).tolist()

    def _predict(self, state: UniPCState, x: torch.Tensor, order: int) -> torch.Tensor:
        """UniP: from sigma[i] (sample x) to sigma[i + 1]."""
        i = state.step_index
        mo = state.model_outputs
        m0 = mo[-1]
        alpha_t, ratio, h_phi_1, b_h, rks, big_r, b = self._bh_terms(
            state.sigmas, i + 1, i, [i - k for k in range(1, order)], order)
        out = ratio * x - alpha_t * h_phi_1 * m0
        if order > 1:
            diffs = [(mo[-(k + 1)] - m0) / rks[k - 1] for k in range(1, order)]
            rhos = [0.5] if order == 2 else self._rhos(big_r[:-1, :-1], b[:-1], x.dtype)
            out = out - alpha_t * b_h * self._weighted(rhos, diffs)
        return out.to(x.dtype)

    def _correct(self, state: UniPCState, x0: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """UniC: redo the last step (from last_sample at sigma[i - 1] to sigma[i]) with the new x0."""
        i = state.step_index
        order = state.this_order
        x = state.last_sample
        mo = state.model_outputs
        m0 = mo[-1]
        alpha_t, ratio, h_phi_1, b_h, rks, big_r, b = self._bh_terms(
            state.sigmas, i, i - 1, [i - 1 - k for k in range(1, order)], order)
        rhos = [0.5] if order == 1 else self._rhos(big_r, b, x.dtype)
        res = (x0 - m0) * rhos[-1]
        if order > 1:
            diffs = [(mo[-(k + 1)] - m0) / rks[k - 1] for k in range(1, order)]
            res = self._weighted(rhos[:-1], diffs) + res
        out = ratio * x - alpha_t * h_phi_1 * m0 - alpha_t * b_h * res
        return out.to(x.dtype)

    def step(self, state: UniPCState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """One step: the model's flow prediction at state.timestep for `sample` -> the next sample.
        Advances state.step_index (and keeps the history the next steps need)."""
        if state.done:
            raise IndexError(f"the schedule is done ({state.num_inference_steps} steps)")
        if len(state.model_outputs) != self.solver_order:
            raise ValueError(f"the state holds {len(state.model_outputs)} model outputs; this scheduler's "
                             f"solver_order is {self.solver_order}")
        i = state.step_index
        n = state.num_inference_steps
        x0 = sample - state.sigmas[i] * model_output
        if i > 0 and (i - 1) not in self.disable_corrector and state.last_sample is not None:
            sample = self._correct(state, x0, sample)
        state.model_outputs = [*state.model_outputs[1:], x0]
        order = min(self.solver_order, n - i) if self.lower_order_final else self.solver_order
        state.this_order = min(order, state.lower_order_nums + 1)
        state.last_sample = sample
        out = self._predict(state, sample, state.this_order)
        state.lower_order_nums = min(state.lower_order_nums + 1, self.solver_order)
        state.step_index = i + 1
        return out
