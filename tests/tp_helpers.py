"""Test-only helpers for the tensor-parallel tests on the CPU (tests/test_tp.py and the tp=2
checks elsewhere): an engine at a given tp, greedy tokens for a batch of prompts, and a close
that checks no follower or process group is left behind."""

from __future__ import annotations

from engine_helpers import model_dir, prompts, run_all
from mstar.models import parallel
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.request import EngineRequest, SamplingParams

PS = prompts(5, 2, 40, seed=77)  # different lengths, some over a page


def tp_engine(kind_or_dir: str, tp: int, **opts):
    from mstar.runtime.engine.engine_core import EngineCore
    opts.setdefault("dtype", "float32")
    opts.setdefault("device", "cpu")
    opts.setdefault("max_model_len", 256)
    opts.setdefault("page_size", 8)
    path = model_dir(kind_or_dir) if kind_or_dir in ("qwen3", "qwen3.5") else kind_or_dir
    return EngineCore(EngineConfig(model=path, tp=tp, **opts))


def closed_cleanly(core) -> None:
    procs = list(core.tp._procs)
    core.close()
    assert not any(p.is_alive() for p in procs)
    assert parallel.tp_size() == 1
    import torch.distributed as dist
    assert not dist.is_initialized()


def run_greedy(core, ps, n=32, prefix="r"):
    reqs = [EngineRequest(f"{prefix}{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(ps)]
    got = run_all(core, reqs)
    return [got[f"{prefix}{i}"][0] for i in range(len(ps))]
