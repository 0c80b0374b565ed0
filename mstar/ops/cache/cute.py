"""CuTe DSL kernels compiled ahead of time, stored in the kernel cache, loaded with tvm-ffi only.

A backend module declares a kernel family once:

    norm = cute.define("rms_norm", source=__file__, builder=_build_rms_norm)

`builder(params)` runs only where the DSL is installed; it imports cutlass, defines the kernel
for one specialization (`params`: every compile-time choice, dtypes included, as a flat dict of
str/int/bool) and returns `(jit_function, compile_args)` for `cute.compile`. At call time the
backend asks `norm.get(params, arch)` for a `tvm_ffi.Function` and calls it with torch tensors;
tvm-ffi passes torch's current stream (the kernel's stream argument is a tvm-ffi environment
stream), so the launch follows `torch.cuda.stream(...)` and CUDA-graph capture.

Key of one entry: SHA-256 over {kernel name, SHA-256 of the kernel's source file(s) and of this
file's BUILD_VERSION, params, arch, nvidia-cutlass-dsl version, apache-tvm-ffi version}.
Build: `cute.compile(..., options="--enable-tvm-ffi --gpu-arch <arch>")` (no GPU needed), then
`export_to_c` to an object file, then `cc -shared` to `kernel.so`, whose undefined symbols are
resolved at load time from libtvm_ffi (loaded by `import tvm_ffi`) and libcute_dsl_runtime.so
(MSTAR_CUTE_RUNTIME_LIB, else the DSL wheel's copy), which we load with RTLD_GLOBAL first.

Lookup: where the DSL is installed the exact key must be present (a DSL upgrade misses and
rebuilds). Where it is not (an offline GPU host with only tvm-ffi and the runtime library), the
DSL version cannot be known, so the newest intact entry with the same spec id (everything but
the DSL version) and the same tvm-ffi version is taken; without one the kernel is unavailable
and the backend falls back to the next one.

`STATS` counts compiles and loads in this process (tests assert a warm process compiled
nothing); `EVENTS` keeps one record per kernel resolved, with compile / link / load seconds.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mstar import knobs
from mstar.ops.cache import store

log = logging.getLogger("mstar.ops.cache")

BUILD_VERSION = "cute-aot-1"  # bump when the build / export / link procedure changes
KIND = "cute"
SO_NAME = "kernel.so"

STATS = {"compiled": 0, "loaded": 0, "memo_hits": 0, "misses_unbuildable": 0}
EVENTS: list[dict] = []

_lock = threading.RLock()
_MISSING = object()
_runtime_handle: list[Any] = []
_modules: list[Any] = []  # keep loaded tvm-ffi modules alive for the process
_tmp_dirs: list[tempfile.TemporaryDirectory] = []


# --- toolchain facts (none of these import the DSL) ---------------------------------------------
@functools.lru_cache(maxsize=None)
def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def dsl_version() -> str | None:
    return _dist_version("nvidia-cutlass-dsl")


def tvm_ffi_version() -> str | None:
    v = _dist_version("apache-tvm-ffi")
    if v is None and importlib.util.find_spec("tvm_ffi") is not None:
        import tvm_ffi

        v = getattr(tvm_ffi, "__version__", None)
    return v


def dsl_installed() -> bool:
    return dsl_version() is not None and importlib.util.find_spec("cutlass") is not None


def linker() -> str | None:
    for c in (os.environ.get("CC"), "cc", "gcc", "g++", "clang"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def can_build() -> bool:
    return dsl_installed() and tvm_ffi_version() is not None and linker() is not None


def runtime_lib() -> str | None:
    """libcute_dsl_runtime.so: MSTAR_CUTE_RUNTIME_LIB, else the copy in the DSL's wheel."""
    p = knobs.value("MSTAR_CUTE_RUNTIME_LIB")
    if p:
        return p if os.path.isfile(p) else None
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for cu in ("cu13", "cu12"):
            cand = Path(base) / cu / "lib" / "libcute_dsl_runtime.so"
            if cand.is_file():
                return str(cand)
    return None


def can_load() -> bool:
    return importlib.util.find_spec("tvm_ffi") is not None and runtime_lib() is not None


_ARCH: dict[Any, str] = {}


def arch_of_device(device: Any = None) -> str:
    """'sm_90a' for an H100/H200 ('a' suffix from 9.0 on, as the DSL names them). Memoised."""
    idx = getattr(device, "index", device)
    arch = _ARCH.get(idx)
    if arch is None:
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        arch = _ARCH[idx] = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    return arch


def _canon(params: dict) -> dict:
    out = {}
    for k in sorted(params):
        v = params[k]
        if not isinstance(v, (str, int, bool, float)):
            raise TypeError(f"kernel param {k}={v!r}: only str/int/bool/float are allowed")
        out[k] = v
    return out


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# --- a kernel family -----------------------------------------------------------------------------
@dataclass
class CuteKernel:
    name: str
    sources: tuple[str, ...]
    builder: Callable[[dict], tuple[Any, tuple]]
    _memo: dict = field(default_factory=dict)  # (params json, arch) -> tvm_ffi.Function | None
    _source_hash: str | None = None

    def source_hash(self) -> str:
        if self._source_hash is None:
            h = hashlib.sha256(BUILD_VERSION.encode())
            for src in self.sources:
                h.update(Path(src).read_bytes())
            self._source_hash = h.hexdigest()
        return self._source_hash

    def spec_fields(self, params: dict, arch: str) -> dict:
        return {"kernel": self.name, "source_sha256": self.source_hash(), "params": _canon(params), "arch": arch}

    def key_fields(self, params: dict, arch: str) -> dict:
        return dict(self.spec_fields(params, arch), cutlass_dsl=dsl_version(), tvm_ffi=tvm_ffi_version())

    def key(self, params: dict, arch: str) -> str:
        return _sha(self.key_fields(params, arch))[:24]

    def kernel_dir(self) -> Path:
        return store.root() / KIND / self.name

    def symbol(self, key: str) -> str:
        return f"mstar_{self.name}_{key[:12]}"

    # --- lookup --------------------------------------------------------------------------------
    def find(self, params: dict, arch: str) -> store.Entry | None:
        """The intact cached entry for this specialization, or None (see the module doc)."""
        if not store.enabled():
            return None
        if dsl_installed():
            key = self.key(params, arch)
            return store.read_entry(self.kernel_dir() / key, key)
        spec_id = _sha(self.spec_fields(params, arch))
        tvm = tvm_ffi_version()
        cands = []
        kdir = self.kernel_dir()
        for edir in (p for p in kdir.iterdir() if p.is_dir()) if kdir.is_dir() else []:
            try:
                meta = json.loads((edir / store.META).read_text())
            except (OSError, ValueError):
                continue
            if meta.get("spec_id") == spec_id and meta.get("fields", {}).get("tvm_ffi") == tvm:
                cands.append((meta.get("created", ""), edir, meta.get("key")))
        for _, edir, key in sorted(cands, key=lambda c: c[0], reverse=True):
            e = store.read_entry(edir, key)
            if e is not None:
                return e
        return None

    def has_any_entry(self) -> bool:
        kdir = self.kernel_dir()
        return store.enabled() and kdir.is_dir() and any((p / store.META).is_file() for p in kdir.iterdir())

    def available(self) -> bool:
        """Can this family run at all here (loadable, and buildable or with something cached)?"""
        return can_load() and (can_build() or self.has_any_entry())

    # --- build ---------------------------------------------------------------------------------
    def _compile_to(self, params: dict, arch: str, key: str, workdir: Path) -> tuple[Path, dict]:
        if not can_build():
            raise RuntimeError(f"cannot build CuTe kernel {self.name}: needs nvidia-cutlass-dsl, "
                               f"apache-tvm-ffi and a C compiler (cc) on this machine")
        import cutlass.cute as cute  # the DSL: only here

        t0 = time.perf_counter()
        fn, args = self.builder(dict(params))
        compiled = cute.compile(fn, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")
        t1 = time.perf_counter()
        obj = workdir / "kernel.o"
        compiled.export_to_c(str(obj), function_name=self.symbol(key), export_only_tvm_ffi_symbols=True)
        so = workdir / SO_NAME
        res = subprocess.run([linker(), "-shared", "-o", str(so), str(obj)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"linking {self.name} failed: {res.stderr.strip()[:2000]}")
        t2 = time.perf_counter()
        STATS["compiled"] += 1
        timings = {"compile_s": round(t1 - t0, 4), "link_s": round(t2 - t1, 4)}
        log.info("cute: compiled %s %s for %s in %.2fs (+ export/link %.2fs)", self.name, params, arch,
                 t1 - t0, t2 - t1)
        return so, timings

    def build(self, params: dict, arch: str, force: bool = False) -> store.Entry:
        """Compile this specialization into the cache (under the entry lock) unless it is there."""
        if not store.enabled():
            raise RuntimeError("kernel cache is disabled (MSTAR_KERNEL_CACHE_DISABLE)")
        key = self.key(params, arch)
        edir = self.kernel_dir() / key
        with store.locked(edir):
            if not force:
                e = store.read_entry(edir, key)
                if e is not None:
                    return e
            with tempfile.TemporaryDirectory(dir=self.kernel_dir(), prefix=".tmp-build-") as td:
                so, timings = self._compile_to(params, arch, key, Path(td))
                fields = self.key_fields(params, arch)
                meta = {"key": key, "kind": KIND, "kernel": self.name, "symbol": self.symbol(key),
                        "spec_id": _sha(self.spec_fields(params, arch)), "fields": fields,
                        "build": dict(timings, host=os.uname().nodename, linker=os.path.basename(linker() or ""))}
                return store.write_entry(edir, {SO_NAME: so}, meta)

    # --- load ----------------------------------------------------------------------------------
    def get(self, params: dict, arch: str) -> Any | None:
        """A callable tvm_ffi.Function for this specialization, or None if it can neither be
        found in the cache nor built here. Memoised per process."""
        mk = (tuple(sorted(params.items())), arch)
        fn = self._memo.get(mk, _MISSING)
        if fn is not _MISSING:  # the hot path: one dict lookup, no lock
            STATS["memo_hits"] += 1
            return fn
        with _lock:
            if mk in self._memo:
                return self._memo[mk]
            fn = None
            ev: dict = {"kernel": self.name, "params": _canon(params), "arch": arch}
            t0 = time.perf_counter()
            try:
                if store.enabled():
                    e = self.find(params, arch)
                    ev["source"] = "cache"
                    if e is None and can_build():
                        e = self.build(params, arch)
                        ev["source"] = "built"
                        ev.update(e.meta.get("build", {}))
                    if e is not None:
                        ev["key"] = e.key
                        ev["build"] = e.meta.get("build", {})
                        t1 = time.perf_counter()
                        fn = _load(e.file(SO_NAME), e.meta["symbol"])
                        ev["load_s"] = round(time.perf_counter() - t1, 6)
                elif can_build():  # disabled: compile in this process, into a private temp dir
                    td = tempfile.TemporaryDirectory(prefix="mstar-cute-")
                    _tmp_dirs.append(td)
                    key = self.key(params, arch)
                    so, timings = self._compile_to(params, arch, key, Path(td.name))
                    ev.update(timings, source="compiled (cache disabled)")
                    t1 = time.perf_counter()
                    fn = _load(so, self.symbol(key))
                    ev["load_s"] = round(time.perf_counter() - t1, 6)
            except Exception as exc:  # a kernel that cannot be had is unavailable, not an error
                ev["error"] = f"{type(exc).__name__}: {exc}"
                log.warning("cute: %s %s unavailable: %s", self.name, params, ev["error"])
                fn = None
            if fn is None:
                STATS["misses_unbuildable"] += 1
                ev.setdefault("source", "unavailable")
                if "error" not in ev:
                    log.warning("cute: %s %s for %s is not in %s and cannot be built here (no DSL or cache "
                                "disabled); the op runs on its next backend. Build it with `python -m "
                                "mstar.ops.cache build` where nvidia-cutlass-dsl is installed.",
                                self.name, params, arch, self.kernel_dir())
            ev["total_s"] = round(time.perf_counter() - t0, 6)
            EVENTS.append(ev)
            self._memo[mk] = fn
            return fn


_KERNELS: dict[str, CuteKernel] = {}


def define(name: str, *, source: str | tuple[str, ...], builder: Callable[[dict], tuple[Any, tuple]]) -> CuteKernel:
    """Declare a CuTe kernel family (once per name)."""
    if name in _KERNELS:
        return _KERNELS[name]
    k = CuteKernel(name, (source,) if isinstance(source, str) else tuple(source), builder)
    _KERNELS[name] = k
    return k


def kernels() -> dict[str, CuteKernel]:
    return dict(_KERNELS)


def _ensure_runtime() -> None:
    if _runtime_handle:
        return
    lib = runtime_lib()
    if lib is None:
        raise RuntimeError("libcute_dsl_runtime.so not found: set MSTAR_CUTE_RUNTIME_LIB "
                           "or install nvidia-cutlass-dsl")
    _runtime_handle.append(ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL))


def _load(so: Path, symbol: str) -> Any:
    _ensure_runtime()
    import tvm_ffi

    mod = tvm_ffi.load_module(str(so))
    _modules.append(mod)
    fn = mod[symbol]
    STATS["loaded"] += 1
    if not _torch_passes_stream():
        fn = _on_torch_stream(fn)
    return fn


def _torch_passes_stream() -> bool:
    """True when torch gives tvm-ffi its current stream with every call (the DLPack exchange API,
    native in recent torch or installed by tvm-ffi); otherwise we set tvm-ffi's env stream ourselves."""
    import torch

    return hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


def _on_torch_stream(fn: Any) -> Callable:
    import tvm_ffi

    def call(*args):
        with tvm_ffi.use_torch_stream():
            return fn(*args)

    return call


@atexit.register
def _cleanup() -> None:
    for td in _tmp_dirs:
        try:
            td.cleanup()
        except Exception:
            pass
