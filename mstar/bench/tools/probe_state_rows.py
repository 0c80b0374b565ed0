"""The GDN state pool's moves around a prefill step's chunk kernel, at the Qwen3.5 4B / 0.8B
shapes with a bfloat16 pool: the rows' states gathered out of the pool in float32, the final states
and their snapshots scattered back. torch's index_select / index_copy_ with casts against
triton_rows.copy_rows (one pass a move), timed inside a CUDA graph; the pools' contents are compared
for equality first.

    python -m mstar.bench.tools.probe_state_rows [--rows 32]

Results: notes/llm-serving.md.
"""

from __future__ import annotations

import argparse

import torch

from mstar.bench.tools.graph_timer import graph_us
from mstar.ops.backends.triton_rows import copy_rows

SHAPES = {"4b": 32, "0.8b": 16}  # value heads (dk = dv = 128)


def torch_moves(pool, slots, final, snap_src, snap_dst):
    state = pool.index_select(0, slots).float()
    state.index_copy_(0, torch.arange(slots.shape[0], device=slots.device), final)
    pool.index_copy_(0, snap_dst, final.index_select(0, snap_src).to(pool.dtype))
    pool.index_copy_(0, slots, state.to(pool.dtype))
    return state


def copy_rows_moves(pool, slots, final, snap_src, snap_dst):
    init = copy_rows(pool, slots, pool.new_empty((slots.shape[0], *pool.shape[1:]), dtype=torch.float32), None)
    copy_rows(final, snap_src, pool, snap_dst)
    copy_rows(final, None, pool, slots)
    return init


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32, help="prefill rows of the step (each with a snapshot)")
    a = p.parse_args(argv)
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}; {a.rows} rows, a snapshot each; us a layer")
    for label, hv in SHAPES.items():
        pool = torch.randn(4 * a.rows + 8, hv, 128, 128, device=dev).to(torch.bfloat16)
        perm = torch.randperm(pool.shape[0], device=dev)
        slots, snap_dst = perm[:a.rows], perm[a.rows:2 * a.rows]
        snap_src = torch.arange(a.rows, device=dev)
        final = torch.randn(a.rows, hv, 128, 128, device=dev)
        p_torch, p_rows = pool.clone(), pool.clone()
        s_torch = pool.index_select(0, slots).float()
        s_rows = copy_rows_moves(p_rows, slots, final, snap_src, snap_dst)
        torch_moves(p_torch, slots, final, snap_src, snap_dst)
        same = torch.equal(p_torch, p_rows) and torch.equal(s_torch, s_rows)
        t_torch = graph_us(lambda _: torch_moves(pool, slots, final, snap_src, snap_dst), reps=5)
        t_rows = graph_us(lambda _: copy_rows_moves(pool, slots, final, snap_src, snap_dst), reps=5)
        print(f"{label}: torch {t_torch:7.1f}  copy_rows {t_rows:7.1f}  ({t_torch / t_rows:.2f}x)  "
              f"equal {same}", flush=True)


if __name__ == "__main__":
    main()
