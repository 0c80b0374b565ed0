"""The Wan2.2 scheduler's configuration as the diffusers layout stores it (scheduler/scheduler_config.json),
apart from the scheduler so that the presets load without torch."""

from __future__ import annotations

from typing import Any

CLASS_NAME = "UniPCMultistepScheduler"
CONFIG_FILE = "scheduler_config.json"

# UniPCMultistepScheduler.__init__'s defaults (diffusers 0.36), for keys a config leaves out.
DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
    "solver_order": 2,
    "prediction_type": "epsilon",
    "thresholding": False,
    "dynamic_thresholding_ratio": 0.995,
    "sample_max_value": 1.0,
    "predict_x0": True,
    "solver_type": "bh2",
    "lower_order_final": True,
    "disable_corrector": [],
    "solver_p": None,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "use_flow_sigmas": False,
    "flow_shift": 1.0,
    "timestep_spacing": "linspace",
    "steps_offset": 0,
    "final_sigmas_type": "zero",
    "rescale_betas_zero_snr": False,
    "use_dynamic_shifting": False,
    "time_shift_type": "exponential",
}

# Wan-AI/Wan2.2-TI2V-5B-Diffusers scheduler/scheduler_config.json (the model card's 720p shift 5.0).
WAN22_TI2V_5B_SCHEDULER: dict[str, Any] = {
    "_class_name": CLASS_NAME,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 5.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "time_shift_type": "exponential",
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_dynamic_shifting": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}

# the N flow sigmas of a schedule (module docstring): diffusers 0.36's, >= 0.40's, the "native" one
FLOW_SIGMAS_WAN = "diffusers-0.36"
FLOW_SIGMAS_DIFFUSERS = "diffusers-0.40"
FLOW_SIGMAS_NATIVE = "native"
FLOW_SIGMAS = (FLOW_SIGMAS_WAN, FLOW_SIGMAS_DIFFUSERS, FLOW_SIGMAS_NATIVE)
