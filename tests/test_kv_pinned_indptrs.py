"""MSTAR_KV_PINNED_INDPTRS (runtime/engine/step_inputs.py, PinnedRing): eager steps stage their packed
index buffers in a preallocated ring of host buffers (page-locked on CUDA; plain tensors on
CPU, where the same ring logic runs) and reuse a slot only once the copy out of it finished.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine_helpers import assert_no_leaks, engine, greedy_requests, hf_greedy, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar import knobs
from mstar.runtime.engine.step_inputs import PinnedRing


class FakeEvent:
    """A CUDA event stand-in: a copy recorded on it stays 'running' until the test completes
    it (or the ring waits on it)."""

    def __init__(self):
        self.done = True
        self.records = 0
        self.waits = 0

    def record(self):
        # the ring writes a slot before recording: its previous copy must have finished
        assert self.done, "a slot was handed out while the copy out of it was still running"
        self.done = False
        self.records += 1

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True
        self.waits += 1


def test_ring_never_hands_out_a_slot_whose_copy_is_running():
    events = []

    def factory():
        events.append(FakeEvent())
        return events[-1]
    ring = PinnedRing("cpu", num_slots=3, nbytes=64, event_factory=factory)
    assert len(events) == 3
    rng = random.Random(0)
    for step in range(400):
        for ev in events:  # copies finish at random
            if not ev.done and rng.random() < 0.3:
                ev.done = True
        i = ring.acquire()
        assert events[i].query(), step
        ring._next = i  # (hand the same slot to to_device, which acquires again)
        arr = np.arange(rng.randint(0, 40), dtype=rng.choice([np.int64, np.int32])) * (step + 1)
        out = ring.to_device(arr)
        assert out.dtype == torch.from_numpy(arr).dtype and out.tolist() == arr.tolist()
    assert sum(e.records for e in events) == 400 == ring.num_copies
    assert ring.num_waits == sum(e.waits for e in events) > 0  # some steps found every copy running
    assert ring.num_grows > 0  # 40 int64 do not fit in 64 bytes


def test_ring_prefers_a_finished_slot_and_waits_on_the_oldest():
    events = []
    ring = PinnedRing("cpu", num_slots=3, nbytes=64, event_factory=lambda: events.append(FakeEvent()) or events[-1])
    a = np.arange(4, dtype=np.int64)
    for _ in range(3):
        ring.to_device(a)  # slots 0, 1, 2: all running now
    events[1].done = True
    assert ring.acquire() == 1 and ring.num_waits == 0  # skips the running slot 0
    ring._next = 1
    ring.to_device(a)  # slot 1 running again; next in turn: 2
    assert ring.acquire() == 2 and events[2].waits == 1 and ring.num_waits == 1  # all running: wait
    # slot 2 was waited on and not written since: free; 0 and 1 still running
    assert ring.acquire() == 2 and ring.num_waits == 1 and events[0].waits == events[1].waits == 0


def test_ring_outputs_do_not_alias_the_slots():
    ring = PinnedRing("cpu", num_slots=2, nbytes=16)
    outs = [ring.to_device(np.full(3, v, dtype=np.int64)) for v in range(5)]
    assert [o.tolist() for o in outs] == [[v] * 3 for v in range(5)]
    assert ring.num_grows == 2  # 24 bytes > 16, once per slot


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
@pytest.mark.parametrize("graphs", ["off", "static"])
def test_tokens_equal_with_the_ring(kind, graphs):
    ps = prompts(7, 3, 60, seed=17)
    reqs = lambda: greedy_requests(ps, lambda i: 6 + 3 * i)  # noqa: E731
    opts = dict(page_size=4, max_num_seqs=4, decode_graphs=graphs, max_num_batched_tokens=48, admit_min_free=0)
    off = engine(kind, **opts)
    assert off.inputs._ring is None
    ref = run_all(off, reqs())
    with knobs.override(MSTAR_KV_PINNED_INDPTRS=True):
        on = engine(kind, **opts)
    ring = on.inputs._ring
    assert isinstance(ring, PinnedRing)
    got = run_all(on, reqs())
    assert got == ref
    assert ring.num_copies >= 2 * (on.num_steps if graphs == "off" else 1)
    for i, p in enumerate(ps):
        assert got[str(i)][0] == hf_greedy(kind, p, 6 + 3 * i)
    assert_no_leaks(on)
