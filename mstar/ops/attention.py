"""Paged-KV attention: append a step's K/V into the page pool, then attend.

Layout (see mstar/models/context.py): k_cache, v_cache [num_pages, page_size, Hkv, D].
A row's kv sequence is the pages kv_indices[kv_indptr[i]:kv_indptr[i+1]] in order, the
last holding kv_last_page_len[i] tokens (1..page_size), so
    kv_len[i] = (num_pages_i - 1) * page_size + kv_last_page_len[i].
The new tokens' K/V are appended before attention, so kv_len counts them and a row with
qo_len n has its queries at positions kv_len - n .. kv_len - 1, each attending causally
to kv positions <= its own. GQA: query head h reads kv head h // (Hq // Hkv).
Index tensors (indptr, indices, last_page_len) are int32; slot_mapping is int64.
indptr and last_page_len may be host (CPU) tensors while q and the caches are on CUDA:
backends that plan on the host (FlashInfer) then read them without a device sync.

The references below are the CPU path and the ground truth: they loop over rows in Python
(each row is one batched matmul over its heads), with scores and softmax in float32.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable

import torch

from mstar import knobs
from mstar.ops.registry import define_op


# --- kv_append ------------------------------------------------------------------------------
def _kv_append_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write k[t], v[t] ([T, Hkv, D]) at flat slot slot_mapping[t] = page * page_size + offset
    (cast to the cache dtype); tokens with a negative slot (padding) are skipped."""
    if k.shape[0] == 0:
        return
    page_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offs = slots - pages * page_size
    # index_put_ on (page, offset) works for any cache strides and writes in place.
    k_cache.index_put_((pages, offs), k.to(k_cache.dtype))
    v_cache.index_put_((pages, offs), v.to(v_cache.dtype))


def _kv_append_fake(k, v, k_cache, v_cache, slot_mapping):
    return None


kv_append = define_op(
    "kv_append",
    "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
    reference=_kv_append_ref, fake=_kv_append_fake)


# --- attention over pages -------------------------------------------------------------------
def _row_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                   kv_len: int, scale: float, out: torch.Tensor) -> None:
    """One row: q [n, Hq, D] (the last n positions of the row's kv sequence) -> out [n, Hq, D]."""
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    # gather the row's pages and drop the unused tail of the last one: [L, Hkv, D] -> [Hkv, L, D]
    k = k_cache.index_select(0, pages).flatten(0, 1)[:kv_len].float().transpose(0, 1)
    v = v_cache.index_select(0, pages).flatten(0, 1)[:kv_len].float().transpose(0, 1)
    # queries grouped by their kv head: [Hkv, g * n, D], index (kv head, group member, token)
    qh = q.float().reshape(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
    s = torch.bmm(qh, k.transpose(1, 2)).mul_(scale)  # [Hkv, g * n, L]
    if n > 1:
        qpos = torch.arange(kv_len - n, kv_len, device=q.device)
        kpos = torch.arange(kv_len, device=q.device)
        future = kpos[None, :] > qpos[:, None]  # [n, L]
        s.view(hkv, g, n, kv_len).masked_fill_(future, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.bmm(p, v)  # [Hkv, g * n, D]
    out.copy_(o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d))


def _check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"paged attention: q heads/dim {tuple(q.shape[1:])} do not fit kv cache "
                         f"heads/dim {tuple(k_cache.shape[2:])} (Hq must be a multiple of Hkv)")


def _paged_attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                                 kv_last_page_len: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ragged query rows q [T, Hq, D] over their paged kv -> [T, Hq, D]."""
    out = q.new_zeros(q.shape)
    rows = max(qo_indptr.shape[0] - 1, 0)
    if rows == 0 or q.shape[0] == 0:
        return out
    _check_heads(q, k_cache)
    page_size = k_cache.shape[1]
    qo = qo_indptr.tolist()
    kvp = kv_indptr.tolist()
    last = kv_last_page_len.tolist()
    indices = kv_indices.long()
    for i in range(rows):
        q0, q1 = qo[i], qo[i + 1]
        if q1 == q0:
            continue
        p0, p1 = kvp[i], kvp[i + 1]
        kv_len = (p1 - p0 - 1) * page_size + last[i]
        _row_attention(q[q0:q1], k_cache, v_cache, indices[p0:p1], kv_len, scale, out[q0:q1])
    return out


def _paged_attention_prefill_fake(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                  scale):
    return q.new_empty(q.shape)


paged_attention_prefill = define_op(
    "paged_attention_prefill",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, "
    "Tensor kv_last_page_len, float scale) -> Tensor",
    reference=_paged_attention_prefill_ref, fake=_paged_attention_prefill_fake)


def _paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                                kv_last_page_len: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row, q [B, Hq, D], attending to the row's whole paged kv -> [B, Hq, D]."""
    out = q.new_zeros(q.shape)
    rows = min(max(kv_indptr.shape[0] - 1, 0), q.shape[0])
    if rows == 0:
        return out
    _check_heads(q, k_cache)
    page_size = k_cache.shape[1]
    kvp = kv_indptr.tolist()
    last = kv_last_page_len.tolist()
    indices = kv_indices.long()
    for i in range(rows):
        p0, p1 = kvp[i], kvp[i + 1]
        kv_len = (p1 - p0 - 1) * page_size + last[i]
        _row_attention(q[i:i + 1], k_cache, v_cache, indices[p0:p1], kv_len, scale, out[i:i + 1])
    return out


def _paged_attention_decode_fake(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale):
    return q.new_empty(q.shape)


paged_attention_decode = define_op(
    "paged_attention_decode",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, Tensor kv_indices, "
    "Tensor kv_last_page_len, float scale) -> Tensor",
    reference=_paged_attention_decode_ref, fake=_paged_attention_decode_fake)

__all__ = ["kv_append", "paged_attention_prefill", "paged_attention_decode"]
_PAGED = (paged_attention_decode, paged_attention_prefill)


# --- decode plans for CUDA graphs -------------------------------------------------------------
class StaticDecodePlan:
    """Paged-decode index arrays held in fixed buffers, so that a captured CUDA graph can
    read a new batch's page tables after `plan()` refreshed them outside the graph.

    The runtime passes `indptr`, `indices` and `last_page_len` (these very tensors) to
    `paged_attention_decode` while capturing and while running eagerly. This base class
    serves the reference backend (and any backend that reads the arrays on the device):
    plan() copies into the buffers. Backends that plan on the host (FlashInfer) subclass
    it and recognise their own buffers by identity."""

    def __init__(self, device, batch: int, max_pages: int, **_):
        device = torch.device(device)
        self.batch = batch
        self.max_pages = max_pages
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(batch, dtype=torch.int32, device=device)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor) -> None:
        """indptr [batch + 1], last_page_len [batch] (host int32), indices [<= max_pages]."""
        n = indices.shape[0]
        if indptr.shape[0] != self.batch + 1 or n > self.max_pages:
            raise ValueError(f"decode plan: {indptr.shape[0] - 1} rows / {n} pages for buffers of "
                             f"{self.batch} rows / {self.max_pages} pages")
        self.indptr.copy_(indptr, non_blocking=True)
        self.last_page_len.copy_(last_page_len, non_blocking=True)
        self.indices[:n].copy_(indices, non_blocking=True)


_DECODE_PLANS: dict[str, Callable[..., StaticDecodePlan]] = {"reference": StaticDecodePlan}
# id(plan.indptr) -> plan, for the backends that recognise their own plan's buffers in a call;
# weak, so an engine's plans go with it
_GRAPH_PLANS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def remember_graph_plan(plan: StaticDecodePlan) -> None:
    """Let `graph_plan_of(plan.indptr)` find this plan (a backend's plan calls it once its
    buffers exist)."""
    _GRAPH_PLANS[id(plan.indptr)] = plan


def graph_plan_of(indptr: torch.Tensor, kind: type) -> StaticDecodePlan | None:
    """The remembered plan of type `kind` whose indptr is this very tensor, else None."""
    plan = _GRAPH_PLANS.get(id(indptr))
    return plan if isinstance(plan, kind) and plan.indptr is indptr else None


class StepMemo:
    """Which step's index arrays a backend's per-step state (a plan, a device copy of the page
    table) was made for: every full-attention layer of a step is handed the same tensors, so the
    state is made once a step. The indptr is held by weak reference (a new step's tensors can never
    be mistaken for the old ones) with its version; `key` is whatever else the state depends on."""

    def __init__(self):
        self.ref = None
        self.version = -1
        self.key = None

    def stale(self, indptr: torch.Tensor, key) -> bool:
        return not (self.ref is not None and self.ref() is indptr and self.version == _version(indptr)
                    and self.key == key)

    def mark(self, indptr: torch.Tensor, key) -> None:
        self.ref = weakref.ref(indptr)
        self.version = _version(indptr)
        self.key = key


def _version(t: torch.Tensor) -> int:
    # inference tensors (the engine runs under inference_mode) keep no version counter;
    # for them the object identity alone says whether the state is current
    try:
        return t._version
    except RuntimeError:
        return -1


def register_decode_plan(backend: str, cls: Callable[..., StaticDecodePlan]) -> None:
    """A backend of paged_attention_decode that needs its own plan object under CUDA graphs: `cls`
    (a class or a function) is called as cls(device, batch, max_pages, num_q_heads=, num_kv_heads=,
    head_dim=, page_size=, dtype=, scale=)."""
    _DECODE_PLANS[backend] = cls


def decode_plan_class(backend: str) -> Callable[..., StaticDecodePlan]:
    """What makes the fixed-buffer decode plans of `backend` (StaticDecodePlan by default)."""
    return _DECODE_PLANS.get(backend, StaticDecodePlan)


def decode_graph_plan(device, *, batch: int, max_pages: int, num_q_heads: int, num_kv_heads: int,
                      head_dim: int, page_size: int, dtype: torch.dtype, scale: float) -> StaticDecodePlan:
    """The fixed-buffer decode plan of the backend selected for `device`."""
    backend = paged_attention_decode.selected(torch.device(device).type)
    return decode_plan_class(backend)(device, batch, max_pages, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
               head_dim=head_dim, page_size=page_size, dtype=dtype, scale=scale)


__all__ += ["StaticDecodePlan", "StepMemo", "decode_graph_plan", "decode_plan_class", "register_decode_plan",
            "remember_graph_plan", "graph_plan_of"]


# --- start-up hooks: kernels compiled ahead of the first step --------------------------------
_PREPARE: dict[str, Callable] = {}
_BUILDS: list[threading.Thread] = []  # the builds prepare hooks started, alive until they finish


def register_prepare(backend: str, prepare: Callable) -> None:
    """prepare(device, *, head_dim, dtype): called by `prepare_paged_attention` when `backend` serves
    paged attention on that device; it may start compiling its kernels in a thread, which it
    returns (None: nothing to build)."""
    _PREPARE[backend] = prepare


def prepare_paged_attention(device, *, head_dim: int, dtype: torch.dtype) -> bool:
    """The runtime calls this once it knows the model's attention shape, before its first step, so
    that a backend compiling kernels on first use (FlashInfer's JIT) can start while the rest of
    the start-up (graph capture, Triton's compiles) goes on. True when a build was started."""
    device = torch.device(device)
    done = set()
    started = False
    for op in _PAGED:
        backend = op.selected(device.type)
        if backend in _PREPARE and backend not in done:
            done.add(backend)
            build = _PREPARE[backend](device, head_dim=head_dim, dtype=dtype)
            if build is not None:
                _BUILDS.append(build)
                started = True
    return started


def paged_attention_building() -> bool:
    """Whether a build that `prepare_paged_attention` started is still under way."""
    _BUILDS[:] = [t for t in _BUILDS if t.is_alive()]
    return bool(_BUILDS)


@contextlib.contextmanager
def paged_attention_on_reference():
    """Inside: the paged attention ops run their reference, whatever MSTAR_BACKENDS or the
    priorities select (the knob overridden in this process; the other ops keep their choice).
    The runtime's start-up runs its warm-up this way while a backend's kernels build, so that
    every other kernel of the step compiles beside that build instead of after it."""
    spec = ",".join([knobs.value("MSTAR_BACKENDS")] + [f"{op.name}=reference" for op in _PAGED])
    with knobs.override(MSTAR_BACKENDS=spec):  # an op named twice: the later entry wins
        yield


__all__ += ["register_prepare", "prepare_paged_attention", "paged_attention_building",
            "paged_attention_on_reference"]
