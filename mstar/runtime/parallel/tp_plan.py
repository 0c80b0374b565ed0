"""The step plan of tensor parallelism (tp.py), what rank 0 sends its followers each step.

It is the host arrays the ForwardContext's tensors are views of (two flat int buffers, see
step_inputs.py; recorded by rank 0's PlanRecorder), the context's layout, and the cache
operations rank 0's MirroredCacheManager performed since the previous plan (copy-on-write
page copies, state zeroing / copies at admission, offload / reload host copies, dropped host
copies of freed requests): followers own caches with the same page and slot ids, and replay
these (replay_ops) on their own shard before rebuilding the context and running the forward."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from mstar.runtime.caches.cache_manager import CacheManager
from mstar.runtime.caches.offload import to_device, to_host
from mstar.runtime.engine.step_inputs import StepInputBuilder

if TYPE_CHECKING:
    from mstar.runtime.parallel.tp import TensorParallel


# ==========================================================================================
# the step plan: a ForwardContext as host arrays + layout
# ==========================================================================================
@dataclasses.dataclass(frozen=True)
class _Ref:
    buf: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Host:
    """A host tensor of rank 0's context (indptrs for planning): a host tensor on followers too."""
    t: torch.Tensor


def layout(obj, bufs: list[torch.Tensor]):
    """obj with every tensor replaced by a _Ref into bufs (or a CPU copy if it is not a view of one)."""
    if isinstance(obj, torch.Tensor):
        ptr = obj.untyped_storage().data_ptr()
        for i, b in enumerate(bufs):
            if b.untyped_storage().data_ptr() == ptr and b.dtype == obj.dtype:
                return _Ref(i, obj.storage_offset() - b.storage_offset(), tuple(obj.shape), tuple(obj.stride()))
        if obj.device.type == "cpu":
            return _Host(obj.detach().clone())
        return obj.detach().cpu()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), {f.name: layout(getattr(obj, f.name), bufs) for f in dataclasses.fields(obj)})
    return obj


def rebuild(lay, bufs: list[torch.Tensor], device: torch.device):
    if isinstance(lay, _Ref):
        return torch.as_strided(bufs[lay.buf], lay.shape, lay.stride, bufs[lay.buf].storage_offset() + lay.offset)
    if isinstance(lay, _Host):
        return lay.t
    if isinstance(lay, torch.Tensor):
        return lay.to(device)
    if isinstance(lay, tuple) and len(lay) == 2 and isinstance(lay[0], type) and dataclasses.is_dataclass(lay[0]):
        cls, kw = lay
        return cls(**{k: rebuild(v, bufs, device) for k, v in kw.items()})
    return lay


class PlanRecorder(StepInputBuilder):
    """Rank 0's step input builder: builds the context as usual, then sends the plan."""

    def __init__(self, tp: "TensorParallel", **kw):
        super().__init__(**kw)
        self._tp = tp
        self._rec: list[tuple[np.ndarray, torch.Tensor]] = []

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        t = super()._to_device(arr)
        self._rec.append((arr, t))
        return t

    def build(self, rows):
        self._rec = []
        ctx, n_sample = super().build(rows)
        self._tp.send_step(ctx, n_sample, self._rec)
        return ctx, n_sample


# ==========================================================================================
# cache operations, recorded on rank 0 and replayed by followers
# ==========================================================================================
class MirroredCacheManager(CacheManager):
    """Rank 0's CacheManager: every tensor operation on the caches is also logged (in
    page / slot ids, valid on every rank) for the followers to replay."""

    def __init__(self, *a, **kw):
        self.ops: list[tuple] = []
        self._host_keys = 0
        super().__init__(*a, **kw)

    def take_ops(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def _copy_pages(self, src, dst):
        if src and self.has_attention:
            self.ops.append(("copy_pages", list(src), list(dst)))
        super()._copy_pages(src, dst)

    def _copy_state(self, src, dst):
        self.ops.append(("copy_state", src, dst))
        super()._copy_state(src, dst)

    def _zero_state(self, slot):
        self.ops.append(("zero_state", slot))
        super()._zero_state(slot)

    def _to_host(self, pages, slot):
        h = super()._to_host(pages, slot)
        self._host_keys += 1
        h.tp_key = self._host_keys
        self.ops.append(("to_host", h.tp_key, list(pages), slot))
        return h

    def _to_device(self, host, dst, rows, slot):
        self.ops.append(("to_device", host.tp_key, list(dst), list(rows), slot))
        super()._to_device(host, dst, rows, slot)

    def free(self, req_id):
        r = self._reqs.get(req_id)
        if r is not None and r.host is not None:
            self.ops.append(("drop_host", r.host.tp_key))
        super().free(req_id)


def replay_ops(cm: CacheManager, hosts: dict, ops: list[tuple]) -> None:
    for op in ops:
        kind = op[0]
        if kind == "copy_pages":
            cm._copy_pages(op[1], op[2])
        elif kind == "copy_state":
            cm._copy_state(op[1], op[2])
        elif kind == "zero_state":
            cm._zero_state(op[1])
        elif kind == "to_host":
            hosts[op[1]] = to_host(cm.caches, op[2], op[3])
        elif kind == "to_device":
            to_device(hosts.pop(op[1]), cm.caches, op[2], op[3], op[4])
        elif kind == "drop_host":
            hosts.pop(op[1], None)
        else:
            raise ValueError(f"unknown cache op {kind!r}")

