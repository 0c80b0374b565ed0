"""MSTAR_IDLE_GATHER_US: the engine process's command intake (engine_process.take_commands).

Default 0: an idle engine steps as soon as the first request is in (what was there already comes
along, nothing more). With a gather window, arrivals within it after the first start in the same
step; later ones do not; a busy engine never waits."""

import queue
import threading
import time

from mstar import knobs
from mstar.runtime.engine_process import take_commands


def _feed(q, items, gap_s):
    def run():
        for it in items:
            q.put(it)
            time.sleep(gap_s)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_default_takes_the_first_arrival_at_once():
    assert knobs.value("MSTAR_IDLE_GATHER_US") == 0
    q = queue.Queue()
    t = _feed(q, ["a", "b", "c"], 0.05)
    cmds = []
    take_commands(q, cmds, busy=False, gather_s=knobs.value("MSTAR_IDLE_GATHER_US") / 1e6)
    t.join()
    assert cmds == ["a"]  # b and c came 50 and 100 ms later: the next step's


def test_gather_window_takes_a_burst_and_stops_at_its_end():
    q = queue.Queue()
    t = _feed(q, ["a", "b", "c"], 0.01)  # a burst: 10 ms apart
    cmds = []
    t0 = time.monotonic()
    take_commands(q, cmds, busy=False, gather_s=0.1)
    waited = time.monotonic() - t0
    assert cmds == ["a", "b", "c"] and waited < 1.0
    late = []
    t2 = _feed(q, ["d"], 0)
    t2.join()
    time.sleep(0.01)
    take_commands(q, late, busy=True, gather_s=0.1)  # busy: only what is there, no waiting
    assert late == ["d"]
    t.join()


def test_gather_window_is_bounded():
    q = queue.Queue()
    t = _feed(q, ["a", "b"], 0.3)  # b comes after the 50 ms window
    cmds = []
    take_commands(q, cmds, busy=False, gather_s=0.05)
    assert cmds == ["a"]
    t.join()
    cmds2 = []
    take_commands(q, cmds2, busy=True)
    assert cmds2 == ["b"]
