"""Faster backends for the ops, each registered under the existing op names.

A backend module is imported only where it can run (CUDA present and its package
importable), so a CPU machine never pays for importing Triton, FlashInfer or fla.
`load()` is called once by `mstar.ops`; it is a no-op without CUDA.
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger("mstar.ops")

# module -> the package it needs
_MODULES = {
    "mstar.ops.backends.triton_norm": "triton",
    "mstar.ops.backends.triton_layer_norm": "triton",
    "mstar.ops.backends.triton_elementwise": "triton",
    "mstar.ops.backends.triton_gdn": "triton",
    "mstar.ops.backends.triton_conv1d": "triton",
    "mstar.ops.backends.triton_snake": "triton",
    "mstar.ops.backends.triton_adain": "triton",
    "mstar.ops.backends.triton_modulate": "triton",
    "mstar.ops.backends.triton_rms_norm_rotary": "triton",
    "mstar.ops.backends.triton_fp8": "triton",
    "mstar.ops.backends.triton_fused_linear": "triton",
    "mstar.ops.backends.fla_gdn": "fla",
    "mstar.ops.backends.flashinfer_attention": "flashinfer",
    "mstar.ops.backends.triton_paged_decode": "triton",  # priority 40: up to 8 rows, FlashInfer's for the rest
    "mstar.ops.backends.flashinfer_dense_attention": "flashinfer",  # priority 4: cuDNN's stays the default
    "mstar.ops.backends.triton_sampling": "triton",  # priority -1: MSTAR_BACKENDS=sample=triton selects it
    # CuTe DSL kernels compiled ahead of time: loading needs only tvm-ffi (+ libcute_dsl_runtime.so)
    "mstar.ops.backends.cute_norm": "tvm_ffi",
    "mstar.ops.backends.cute_gdn": "tvm_ffi",
}

_loaded: dict[str, str] = {}  # module -> "ok" or the reason it is absent


def _has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def load(force: bool = False) -> dict[str, str]:
    """Import every backend module that can run here. Returns {module: status}."""
    import torch

    if _loaded and not force:
        return _loaded
    for mod, pkg in _MODULES.items():
        if not (torch.cuda.is_available() or force):
            _loaded[mod] = "no CUDA"
            continue
        if not _has_package(pkg):
            _loaded[mod] = f"{pkg} not installed"
            continue
        try:
            importlib.import_module(mod)
            _loaded[mod] = "ok"
        except Exception as e:  # a broken optional backend must not take the op layer down
            _loaded[mod] = f"import failed: {type(e).__name__}: {e}"
            log.warning("backend %s not loaded: %s", mod, _loaded[mod])
    missing = sorted({pkg for mod, pkg in _MODULES.items() if _loaded[mod] == f"{pkg} not installed"})
    if missing and torch.cuda.is_available():
        # silent otherwise: the ops would run on their reference backends (several times slower)
        log.warning("CUDA without %s: the ops those backends serve run on their reference backends "
                    "(pip install -e '.[gpu]'; `mstar ops` lists what loaded)", ", ".join(missing))
    return _loaded
