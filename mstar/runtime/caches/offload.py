"""Host copies of one request's KV pages and recurrent state (preemption by swapping).

`to_host` gathers the rows of the given pages from every attention layer's k/v cache and
the rows of one state slot from every GDN layer's pools into CPU tensors (pinned when
CUDA is available, copied asynchronously on the current stream: later kernels that
reuse the pages, and the copies back, are ordered after it on the same stream; CPU
reads wait for the event recorded after it, `HostCopy.wait`). `to_device` scatters
them back into other pages / another slot. One gather or scatter per tensor, no loops
over elements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar.models.context import ModelCaches


@dataclass
class HostCopy:
    num_pages: int
    k: list[torch.Tensor] = field(default_factory=list)  # [num_pages, page_size, Hkv, D] per layer
    v: list[torch.Tensor] = field(default_factory=list)
    conv: list[torch.Tensor] = field(default_factory=list)  # [conv_dim, K-1] per GDN layer
    recurrent: list[torch.Tensor] = field(default_factory=list)  # [Hv, Dk, Dv] per GDN layer
    done: object | None = None  # CUDA event recorded after the asynchronous device-to-host copies

    def wait(self) -> None:
        """Block until the host tensors hold the data (before reading them on the CPU)."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.conv, *self.recurrent))


def _pin() -> bool:
    return torch.cuda.is_available()


def _host(src: torch.Tensor, pin: bool) -> torch.Tensor:
    if src.device.type == "cpu":
        return src.clone()
    dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
    dst.copy_(src, non_blocking=pin)
    return dst


def to_host(caches: ModelCaches, pages: list[int], slot: int | None) -> HostCopy:
    pin = _pin()
    out = HostCopy(num_pages=len(pages))
    if pages and caches.k_caches:
        idx = torch.tensor(pages, dtype=torch.long, device=caches.k_caches[0].device)
        out.k = [_host(k.index_select(0, idx), pin) for k in caches.k_caches]
        out.v = [_host(v.index_select(0, idx), pin) for v in caches.v_caches]
    if slot is not None:
        out.conv = [_host(c[slot], pin) for c in caches.conv_states]
        out.recurrent = [_host(r[slot], pin) for r in caches.recurrent_states]
    if pin and any(t.is_pinned() for t in (*out.k, *out.conv)):
        out.done = torch.cuda.Event()
        out.done.record()
    return out


def to_device(host: HostCopy, caches: ModelCaches, dst_pages: list[int], src_rows: list[int],
              slot: int | None) -> None:
    """Write host rows src_rows (indices into the copied pages) into pages dst_pages, and
    the copied state into `slot`."""
    if dst_pages and caches.k_caches:
        dev = caches.k_caches[0].device
        idx = torch.tensor(dst_pages, dtype=torch.long, device=dev)
        every = src_rows == list(range(host.num_pages))
        rows = None if every else torch.tensor(src_rows, dtype=torch.long)
        if not every:
            host.wait()  # the row selection below reads the host copy on the CPU
        for cache, h in zip((*caches.k_caches, *caches.v_caches), (*host.k, *host.v)):
            src = h if every else h.index_select(0, rows)
            cache.index_copy_(0, idx, src.to(dev, non_blocking=True))
    if slot is not None:
        for cache, h in zip((*caches.conv_states, *caches.recurrent_states), (*host.conv, *host.recurrent)):
            cache[slot].copy_(h, non_blocking=True)
