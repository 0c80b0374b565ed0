"""Point the toolchains' own compile caches under the kernel-cache root.

    Triton         TRITON_CACHE_DIR           <root>/triton
    Inductor       TORCHINDUCTOR_CACHE_DIR    <root>/inductor    (FX graph, AOT autograd, autotune caches)
    torch.compile  cache artifacts            <root>/torch_compile/<name>.bin  (save/load helpers below)
    FlashInfer     FLASHINFER_WORKSPACE_BASE  <root>/flashinfer  (its JIT builds land under it)

`configure()` runs once, from `mstar.ops`'s import, before any backend module imports Triton
or FlashInfer (FlashInfer reads its variable when it is imported). It only sets variables
the user has not set, imports none of these packages, and does nothing when
MSTAR_KERNEL_CACHE_DISABLE is on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mstar.ops.cache import store

log = logging.getLogger("mstar.ops.cache")

ENV_DIRS = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
}

_configured: dict[str, str] | None = None


def configure(force: bool = False) -> dict[str, str]:
    """Set the toolchain cache variables under the root (where unset). Returns {var: path} as set
    by this call or a previous one; {} when the cache is disabled."""
    global _configured
    if _configured is not None and not force:
        return _configured
    out: dict[str, str] = {}
    try:
        if store.enabled():
            base = store.root()
            for var, sub in ENV_DIRS.items():
                if os.environ.get(var):
                    continue  # the user's explicit choice wins
                os.environ[var] = str(base / sub)
                out[var] = os.environ[var]
    except Exception as e:  # a bad knob is reported by the knob check at start-up, not here
        log.debug("kernel cache: toolchain dirs not set: %s", e)
    _configured = out
    return out


def torch_compile_artifacts_path(name: str) -> Path:
    return store.root() / "torch_compile" / f"{name}.bin"


def save_torch_compile_artifacts(name: str) -> Path | None:
    """Save this process's torch.compile cache artifacts (torch.compiler.save_cache_artifacts)
    under the root, for `load_torch_compile_artifacts(name)` in a later process."""
    import torch

    if not store.enabled():
        return None
    got = torch.compiler.save_cache_artifacts()
    if got is None:
        return None
    data = got[0]
    path = torch_compile_artifacts_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    store._atomic_write(path, bytes(data))
    return path


def load_torch_compile_artifacts(name: str) -> bool:
    """Pre-load saved torch.compile artifacts (hot-loads Inductor/AOTAutograd caches). False if none."""
    import torch

    path = torch_compile_artifacts_path(name)
    if not store.enabled() or not path.is_file():
        return False
    try:
        return torch.compiler.load_cache_artifacts(path.read_bytes()) is not None
    except Exception as e:  # a stale or corrupt blob is a miss, not an error
        log.warning("torch.compile artifacts %s not loaded: %s", path, e)
        return False
