"""Which FlashInfer backend runs paged prefill, and the fa2 module compiled ahead of use.

FlashInfer compiles each kernel variant on first use. Hopper's fa3 batch-prefill module takes
about three times as long to build as fa2's (which the decode rows run through as well), and is
the faster prefill kernel on long prompts, level with fa2 on batches of short ones
(notes/startup.md has both measured).

`prefill_backend` (MSTAR_PREFILL_ATTENTION): "auto" on Hopper takes fa3 where its module is
already compiled (the kernel cache) and fa2 where it is not, so that a cold start compiles one
module instead of two. One start with MSTAR_PREFILL_ATTENTION=fa3 compiles fa3's module into the
kernel cache; "auto" takes it from then on. The choice is made once per process, at its first
prefill, so a server's outputs do not change over its life. Off Hopper "auto" is FlashInfer's
own choice. "fa2" / "fa3" force one.

`prepare` compiles the fa2 module in a background thread while the runtime's start-up (graph
capture, Triton's compiles) goes on; the first call that needs it waits on FlashInfer's build
lock and then loads it.
"""

from __future__ import annotations

import logging
import threading

import torch

from mstar import knobs

log = logging.getLogger("mstar.ops")

_chosen: dict[tuple, str] = {}  # (device, dtype, head_dim) -> backend, fixed at the first prefill
_lock = threading.Lock()


def choose(setting: str, hopper: bool, fa3_compiled: bool) -> str:
    """The backend for MSTAR_PREFILL_ATTENTION = setting (module docstring)."""
    if setting != "auto":
        return setting
    if not hopper:
        return "auto"  # FlashInfer's own choice
    return "fa3" if fa3_compiled else "fa2"


def _module_args(dtype: torch.dtype, head_dim: int) -> tuple:
    # q, kv, out dtypes; index dtype; qk / vo head dims; no rotary, no window, no soft cap, no fp16 qk
    return (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False)


def _spec(backend: str, dtype: torch.dtype, head_dim: int):
    """FlashInfer's JitSpec of the batch-prefill module the wrapper would build, or None where this
    FlashInfer has no such function (then nothing is built ahead of use)."""
    try:
        from flashinfer.jit.attention import modules
        if backend == "fa2":  # what get_batch_prefill_module builds for fa2: equal-stride pages
            return modules._gen_batch_prefill_primary_module(backend, *_module_args(dtype, head_dim))
        return modules.gen_batch_prefill_module(backend, *_module_args(dtype, head_dim))
    except (ImportError, AttributeError, TypeError) as e:
        log.debug("FlashInfer module spec for %s unavailable: %s", backend, e)
        return None


def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def prefill_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Called on every paged prefill: a dict lookup once the choice is made."""
    key = (device, dtype, head_dim)
    backend = _chosen.get(key)
    if backend is None:
        with _lock:
            setting = knobs.value("MSTAR_PREFILL_ATTENTION")
            hopper = _hopper(device)
            spec = _spec("fa3", dtype, head_dim) if setting == "auto" and hopper else None
            backend = choose(setting, hopper, spec is not None and spec.is_compiled)
            _chosen[key] = backend
            log.info("paged prefill on FlashInfer's %s backend (MSTAR_PREFILL_ATTENTION=%s)", backend, setting)
    return backend


def _build(spec, what: str) -> None:
    try:
        if not spec.is_compiled:
            log.info("FlashInfer: compiling %s in the background", what)
            spec.build()
            log.info("FlashInfer: %s compiled", what)
    except Exception as e:  # noqa: BLE001 -- a failed build ahead of use is retried on use
        log.warning("FlashInfer: compiling %s ahead of use failed: %s", what, e)


def prepare(device: torch.device, *, head_dim: int, dtype: torch.dtype) -> threading.Thread | None:
    """Start compiling the fa2 module in a thread where it is not compiled; the thread, or None."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None  # the reference serves other dtypes
    spec = _spec("fa2", dtype, head_dim)
    if spec is None or spec.is_compiled:
        return None
    build = threading.Thread(target=_build, args=(spec, f"the fa2 prefill module (head_dim {head_dim})"),
                             name="flashinfer-build", daemon=True)
    build.start()
    return build
