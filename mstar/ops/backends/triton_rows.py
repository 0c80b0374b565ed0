"""Whole rows copied between tensors through index lists, cast to the destination's dtype, in one
launch: dst[dst_index[i]] = src[src_index[i]] (either index may be the identity).

The GDN state pool keeps bfloat16 rows that fla's chunk kernel reads and writes in float32: a
prefill step gathers its rows' states out of the pool (cast up) and scatters the final states, and
the snapshots among them, back (cast down). torch does each as an index_select or index_copy_ plus
a cast, two passes and a temporary a move; this is one pass over the bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # elements a program


@triton.jit
def _copy_rows_kernel(src_ptr, src_index_ptr, dst_ptr, dst_index_ptr, row_elems,
                      SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if SRC_INDEXED:
        s = tl.load(src_index_ptr + i).to(tl.int64)
    else:
        s = i.to(tl.int64)
    if DST_INDEXED:
        d = tl.load(dst_index_ptr + i).to(tl.int64)
    else:
        d = i.to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_elems
    x = tl.load(src_ptr + s * row_elems + offs, mask=mask)
    tl.store(dst_ptr + d * row_elems + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def copy_rows(src: torch.Tensor, src_index: torch.Tensor | None, dst: torch.Tensor,
              dst_index: torch.Tensor | None) -> torch.Tensor:
    """dst[dst_index[i]] = src[src_index[i]].to(dst.dtype) for every i (None: i itself); rows are
    the first dim, both tensors contiguous with equal row shapes. Returns dst. Off CUDA (or for
    strided tensors): torch's index_select / index_copy_."""
    n = (src_index if src_index is not None else dst_index if dst_index is not None else src).shape[0]
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"copy_rows: row shapes differ, {tuple(src.shape[1:])} and {tuple(dst.shape[1:])}")
    if n == 0:
        return dst
    if not (src.is_cuda and src.is_contiguous() and dst.is_contiguous()):
        rows = src if src_index is None else src.index_select(0, src_index)
        rows = rows.to(dst.dtype)
        if dst_index is None:
            dst[:n].copy_(rows)
        else:
            dst.index_copy_(0, dst_index, rows)
        return dst
    return launch(src, src_index, dst, dst_index, n)


def launch(src, src_index, dst, dst_index, n: int) -> torch.Tensor:
    """The kernel itself (copy_rows checks the arguments; tests run this in Triton's interpreter)."""
    row_elems = src[0].numel()
    _copy_rows_kernel[(n, triton.cdiv(row_elems, _BLOCK))](
        src, src_index if src_index is not None else src, dst, dst_index if dst_index is not None else dst, row_elems,
        SRC_INDEXED=src_index is not None, DST_INDEXED=dst_index is not None, BLOCK=_BLOCK)
    return dst
