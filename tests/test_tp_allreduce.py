"""MSTAR_TP_ALLREDUCE: which all-reduce sums the row-parallel outputs at tp > 1.

On CPU: the layers' all-reduce goes to an installed fast path only for the tensors it takes
(and only on the default group), everything else to torch.distributed; the knob's default
installs nothing (the default path is the plain torch.distributed call); symm_mem has no
effect off CUDA. On two GPUs: tokens with the one-shot all-reduce equal those with NCCL,
graphs captured around it."""

import logging

import pytest
import torch

from mstar import knobs
from mstar.models import parallel
from mstar.runtime.parallel import tp_allreduce


class _FakeDist:
    def __init__(self):
        self.calls = []

    def all_reduce(self, x, group=None):
        self.calls.append((x, group))
        x.mul_(2)  # two ranks holding the same values


@pytest.fixture()
def fake_dist(monkeypatch):
    import torch.distributed as dist
    fake = _FakeDist()
    monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
    yield fake
    parallel.install_all_reduce(None)


def test_fast_all_reduce_takes_only_what_it_accepts(fake_dist):
    taken = []

    def fast(x):
        if x.dtype != torch.bfloat16:
            return False
        taken.append(x)
        x.mul_(3)
        return True

    parallel.install_all_reduce(fast)
    a = torch.ones(4, dtype=torch.bfloat16)
    assert parallel.all_reduce(a) is a and torch.equal(a, torch.full((4,), 3.0, dtype=torch.bfloat16))
    b = torch.ones(4)  # declined: torch.distributed
    parallel.all_reduce(b)
    assert torch.equal(b, torch.full((4,), 2.0)) and fake_dist.calls == [(b, None)]
    c = torch.ones(4, dtype=torch.bfloat16)  # another group: never the fast path
    parallel.all_reduce(c, group="other")
    assert len(taken) == 1 and fake_dist.calls[-1] == (c, "other")


def test_default_knob_installs_nothing(fake_dist):
    with knobs.override(MSTAR_TP_ALLREDUCE="nccl"):
        assert tp_allreduce.setup(torch.device("cpu"), torch.float32) == "nccl"
    assert parallel._FAST_ALL_REDUCE[0] is None
    x = torch.ones(3)
    parallel.all_reduce(x)
    assert fake_dist.calls == [(x, None)]


def test_symm_mem_has_no_effect_off_cuda(fake_dist, caplog):
    with knobs.override(MSTAR_TP_ALLREDUCE="symm_mem"), caplog.at_level(logging.WARNING):
        assert tp_allreduce.setup(torch.device("cpu"), torch.bfloat16) == "nccl"
    assert parallel._FAST_ALL_REDUCE[0] is None
    assert any("MSTAR_TP_ALLREDUCE=symm_mem has no effect" in r.getMessage() for r in caplog.records)


def test_symm_mem_declines_what_the_kernel_cannot_take():
    """The size / dtype / alignment / layout checks, without a GPU (the kernel is never reached)."""
    ar = tp_allreduce.SymmMemAllReduce.__new__(tp_allreduce.SymmMemAllReduce)
    ar.dtype = torch.bfloat16
    ar.buf = None  # any use of the buffer would fail: every case below must decline first
    assert not ar(torch.ones(8))  # fp32
    assert not ar(torch.ones(3, dtype=torch.bfloat16))  # 6 bytes: not 16-byte vectors
    assert not ar(torch.ones(tp_allreduce.MAX_BYTES // 2 + 8, dtype=torch.bfloat16))  # too large
    assert not ar(torch.ones(16, 8, dtype=torch.bfloat16).t())  # not contiguous
    assert not ar(torch.ones(17, dtype=torch.bfloat16)[1:])  # 32 bytes, but 2 bytes past a vector boundary


def test_followers_take_rank0s_mode_not_their_environment():
    """Rank 0 reads MSTAR_TP_ALLREDUCE once and hands it to the followers. A knob set in rank
    0's process only (override, or a stale reload) must reach them: ranks that sum with different
    all-reduces never pair up (a tp=2 test once hung after one that left symm_mem behind)."""
    from tp_helpers import closed_cleanly, tp_engine
    with knobs.override(MSTAR_TP_ALLREDUCE="symm_mem"):
        core = tp_engine("qwen3", 2)
    try:
        # symm_mem has no effect on CPU: every rank falls back alike, and says so to rank 0
        assert core.tp._allreduce_mode == "symm_mem"
        assert core.tp.allreduce == "nccl" and core.tp.follower_allreduce == [("symm_mem", "nccl")]
    finally:
        closed_cleanly(core)
    core = tp_engine("qwen3", 2)
    try:
        assert core.tp._allreduce_mode == "nccl" and core.tp.follower_allreduce == [("nccl", "nccl")]
    finally:
        closed_cleanly(core)


_ONE_ENGINE = r"""
import json, sys
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.engine_core import EngineCore
from tp_helpers import PS, run_greedy
core = EngineCore(EngineConfig(model=sys.argv[1], device="cuda", dtype="bfloat16", tp=2, max_num_seqs=8,
                               max_model_len=256))
try:
    print(json.dumps({"mode": core.tp.allreduce, "tokens": run_greedy(core, PS, 16)}))
finally:
    core.close()
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_symm_mem_all_reduce_matches_nccl():
    """tp=2 with decode graphs and overlapped decode: the one-shot all-reduce on symmetric
    memory, and the fused all-reduce + add + RMSNorm, give the NCCL engine's tokens. Each engine
    in its own process: PyTorch's symmetric memory does not take a second rendezvous in a process
    whose first group is gone (three engines in one process did not finish in 230 s: notes/tp.md, Limits)."""
    import json
    import os
    import subprocess
    import sys
    from engine_helpers import model_dir
    path = model_dir("qwen3-gpu")  # the 0.6B preset's head shapes: a kernel cache built for the presets holds their kernels
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outs = []
    for mode in ("nccl", "symm_mem", "symm_mem_norm"):
        env = dict(os.environ, MSTAR_TP_ALLREDUCE=mode, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
        r = subprocess.run([sys.executable, "-c", _ONE_ENGINE, path], env=env, capture_output=True, text=True,
                           timeout=150)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["mode"] == mode
        outs.append(got["tokens"])
    # two ranks: the sum of two bf16 values is one rounding whichever kernel adds them, and the
    # fused kernel's add + norm is triton_norm's arithmetic, so the tokens are equal
    assert outs[0] == outs[1] == outs[2]


def test_auto_is_nccl_off_cuda_without_a_warning(fake_dist, caplog):
    with knobs.override(MSTAR_TP_ALLREDUCE="auto"), caplog.at_level(logging.WARNING):
        assert tp_allreduce.setup(torch.device("cpu"), torch.float32) == "nccl"
        assert tp_allreduce.setup(torch.device("cpu"), torch.bfloat16) == "nccl"
    assert parallel._FAST_ALL_REDUCE[0] is None and parallel._FUSED_REDUCE_NORM[0] is None
    assert not caplog.records


def test_auto_asks_for_peer_access_to_every_other_rank(monkeypatch):
    """Rank r runs on GPU base + r: rank 1 of 4 on cuda:3 checks GPUs 2, 4 and 5."""
    import torch.distributed as dist
    asked = []
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: asked.append((a, b)) or b != 5)
    dev = torch.device("cuda", 3)
    assert not tp_allreduce._symmetric_memory_usable(dev, torch.bfloat16)
    assert asked == [(3, 2), (3, 4), (3, 5)]
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert tp_allreduce._symmetric_memory_usable(dev, torch.bfloat16)
    assert not tp_allreduce._symmetric_memory_usable(dev, torch.float32)  # the one-shot kernels take 16-bit dtypes
