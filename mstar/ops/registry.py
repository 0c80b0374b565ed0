"""The op registry: every mstar op, its reference, its backends, and which one runs.

Each op is defined once with a `torch.library` schema in the `mstar` namespace, so that
torch.compile sees it as one opaque node (a fake implementation gives it shapes). The
implementation registered with the dispatcher is a thin switch that calls the backend
selected for the tensor's device:

    reference  plain torch, runs anywhere; the ground truth and the CPU path
    others     registered by backend modules (FlashInfer, Triton, CuTe DSL) where they load

Selection: the knob MSTAR_BACKENDS ("op=backend,...", "*" for every op) or, by default,
the available backend of highest priority for the device. Verify mode (MSTAR_VERIFY=1)
runs the reference beside the selected backend on the same live inputs (cloned where the
op writes into them) and records the largest difference per op.

We define ops with `torch.library.Library.define/impl` rather than the `custom_op`
decorator: the decorator's Python wrapper costs ~4x more per call in eager mode. Outside
torch.compile, `OpEntry.__call__` skips the dispatcher entirely and calls the backend.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mstar import knobs

LIB = torch.library.Library("mstar", "DEF")

_DEVICES = ("cpu", "cuda")
_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}


@dataclass
class Backend:
    name: str
    fn: Callable
    devices: tuple[str, ...]
    available: Callable[[], bool]
    priority: int
    note: str = ""

    def is_available(self) -> bool:
        try:
            return bool(self.available())
        except Exception:  # an import or probe that fails means "not here"
            return False


@dataclass
class OpEntry:
    name: str
    schema: str
    doc: str
    overload: Any  # torch._ops.OpOverload
    backends: dict[str, Backend] = field(default_factory=dict)
    mutated_args: tuple[int, ...] = ()
    returns_nothing: bool = False
    _resolved: dict[str, Backend] = field(default_factory=dict)

    # --- selection ----------------------------------------------------------------------
    def resolve(self, device: str) -> Backend:
        b = self._resolved.get(device)
        if b is None:
            b = _select(self, device)
            self._resolved[device] = b
        return b

    def selected(self, device: str) -> str:
        return self.resolve(device).name

    # --- calling ------------------------------------------------------------------------
    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.overload(*args)
        return self._impl(_device_of(args), args)

    def _impl(self, device: str, args: tuple):
        backend = self.resolve(device)
        if _verify_enabled[0] and backend.name != "reference":
            out = _verified_call(self, backend, args)
        else:
            out = backend.fn(*args)
        return None if self.returns_nothing else out


_OPS: dict[str, OpEntry] = {}
_verify_enabled = [False]
_verify_lock = threading.Lock()
_verify_max: dict[str, float] = {}
_verify_calls: dict[str, int] = {}


def _device_of(args: tuple) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


def define_op(name: str, schema: str, *, reference: Callable, fake: Callable,
              doc: str = "") -> OpEntry:
    """Define `mstar::<name><schema>` with its reference implementation and fake."""
    if name in _OPS:
        raise ValueError(f"op {name} defined twice")
    LIB.define(f"{name}{schema}")
    overload = getattr(torch.ops.mstar, name).default
    mutated = tuple(i for i, a in enumerate(overload._schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    entry = OpEntry(name=name, schema=schema, doc=doc or (reference.__doc__ or "").strip().split("\n")[0],
                    overload=overload, mutated_args=mutated,
                    returns_nothing=len(overload._schema.returns) == 0)
    entry.backends["reference"] = Backend("reference", reference, _DEVICES, lambda: True, 0,
                                          "plain torch")
    for dev in _DEVICES:
        LIB.impl(name, _dispatch_impl(entry, dev), _DISPATCH_KEY[dev])
    torch.library.register_fake(f"mstar::{name}", fake, lib=LIB)
    _OPS[name] = entry
    return entry


def _dispatch_impl(entry: OpEntry, device: str) -> Callable:
    def impl(*args):
        return entry._impl(device, args)
    impl.__name__ = f"{entry.name}_{device}"
    return impl


def register_backend(op: str | OpEntry, name: str, fn: Callable, *, devices: tuple[str, ...] = ("cuda",),
                     available: Callable[[], bool] | None = None, priority: int = 10,
                     note: str = "") -> None:
    """Add a backend to an op. Higher priority wins the default choice when available."""
    entry = op if isinstance(op, OpEntry) else _OPS[op]
    if name in entry.backends:
        raise ValueError(f"backend {name} registered twice for op {entry.name}")
    entry.backends[name] = Backend(name, fn, tuple(devices), available or (lambda: True), priority, note)
    entry._resolved.clear()


def get(name: str) -> OpEntry:
    return _OPS[name]


def all_ops() -> list[OpEntry]:
    return [_OPS[k] for k in sorted(_OPS)]


# --- selection ------------------------------------------------------------------------------
def parse_backend_spec(spec: str) -> dict[str, str]:
    """'a=x,b=y' -> {'a': 'x', 'b': 'y'}; names are checked by `validate_selection`."""
    out: dict[str, str] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise knobs.KnobError(f"MSTAR_BACKENDS: {part!r} is not of the form op=backend")
        op, backend = (s.strip() for s in part.split("=", 1))
        out[op] = backend
    return out


def validate_selection() -> None:
    """Raise KnobError if MSTAR_BACKENDS names an unknown op or backend (call at start-up)."""
    spec = parse_backend_spec(knobs.value("MSTAR_BACKENDS"))
    for op, backend in spec.items():
        if op == "*":
            continue
        if op not in _OPS:
            raise knobs.KnobError(f"MSTAR_BACKENDS: unknown op {op!r} (see `python -m mstar.ops`)")
        if backend not in _OPS[op].backends:
            raise knobs.KnobError(f"MSTAR_BACKENDS: op {op!r} has no backend {backend!r}; "
                                  f"it has {sorted(_OPS[op].backends)}")


def _select(entry: OpEntry, device: str) -> Backend:
    spec = parse_backend_spec(knobs.value("MSTAR_BACKENDS"))
    want = spec.get(entry.name, spec.get("*"))
    if want is not None and want in entry.backends:
        b = entry.backends[want]
        if device in b.devices and b.is_available():
            return b
        if entry.name in spec:  # asked for this op by name: say why it cannot run
            raise RuntimeError(f"MSTAR_BACKENDS asks {entry.name}={want}, which is not available "
                               f"on {device}")
    candidates = [b for b in entry.backends.values() if device in b.devices and b.is_available()]
    return max(candidates, key=lambda b: b.priority)


def _reset_selection() -> None:
    for e in _OPS.values():
        e._resolved.clear()
    _verify_enabled[0] = bool(knobs.value("MSTAR_VERIFY"))


knobs.on_change(_reset_selection)


# --- verify mode ---------------------------------------------------------------------------
def _clone_arg(a):
    return a.clone() if isinstance(a, torch.Tensor) else a


def _max_diff(a, b) -> float:
    if a is None or b is None:
        return 0.0
    if isinstance(a, torch.Tensor):
        if a.numel() == 0:
            return 0.0
        if not a.is_floating_point():
            return float((a != b).sum().item())
        return float((a.double() - b.double()).abs().max().item())
    if isinstance(a, (tuple, list)):
        return max((_max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0


def _verified_call(entry: OpEntry, backend: Backend, args: tuple):
    ref_args = tuple(_clone_arg(a) if i in entry.mutated_args else a for i, a in enumerate(args))
    out = backend.fn(*args)
    ref = entry.backends["reference"].fn(*ref_args)
    diff = _max_diff(out, ref)
    for i in entry.mutated_args:
        diff = max(diff, _max_diff(args[i], ref_args[i]))
    with _verify_lock:
        _verify_max[entry.name] = max(_verify_max.get(entry.name, 0.0), diff)
        _verify_calls[entry.name] = _verify_calls.get(entry.name, 0) + 1
    return out


def verify_report() -> dict[str, dict[str, float]]:
    """{op: {"calls": n, "max_abs_diff": d}} for every op checked since the last reset."""
    with _verify_lock:
        return {k: {"calls": _verify_calls[k], "max_abs_diff": _verify_max[k]} for k in sorted(_verify_max)}


def reset_verify_report() -> None:
    with _verify_lock:
        _verify_max.clear()
        _verify_calls.clear()


# --- table ---------------------------------------------------------------------------------
def format_table() -> str:
    cuda = torch.cuda.is_available()
    rows = [("op", "backends (* = available here)", "cpu", "cuda")]
    for e in all_ops():
        names = " ".join(f"{b.name}{'*' if b.is_available() else ''}"
                         for b in sorted(e.backends.values(), key=lambda b: -b.priority))
        rows.append((e.name, names, e.selected("cpu"), e.selected("cuda") if cuda else "-"))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(r[i].ljust(w[i]) for i in range(4)).rstrip() for r in rows)


_verify_enabled[0] = bool(knobs.value("MSTAR_VERIFY"))
