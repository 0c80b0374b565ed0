"""MSTAR_IDLE_GATHER_US: the engine process's command intake (engine_process.take_commands).

Default 0: an idle engine steps as soon as the first request is in (what was there already comes
along, nothing more). With a gather window, arrivals within it after the first start in the same
step; later ones do not; a busy engine never waits."""

import queue
import threading
import time

from mstar import knobs
from mstar.runtime.engine.engine_process import take_commands


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


def test_waiting_only_engine_gathers_without_blocking_for_a_first():
    """Busy with requests that wait for admission but nothing running (a closed-loop wave's first
    request arrived while the last wave was still decoding): the window applies, with nothing to
    block for first; an empty queue returns after the window, not after IDLE_POLL_S."""
    q = queue.Queue()
    t = _feed(q, ["b", "c"], 0.01)
    cmds = []
    t0 = time.monotonic()
    take_commands(q, cmds, busy=True, gather_s=0.1, running=False)
    assert cmds == ["b", "c"] and time.monotonic() - t0 < 1.0
    t.join()
    cmds = []
    t0 = time.monotonic()
    take_commands(q, cmds, busy=True, gather_s=0.02, running=False)
    assert cmds == [] and time.monotonic() - t0 < 0.5
    t = _feed(q, ["d", "e"], 0.05)  # running: only what is there
    time.sleep(0.01)
    cmds = []
    take_commands(q, cmds, busy=True, gather_s=0.1, running=True)
    assert cmds == ["d"]
    t.join()


def test_engine_running_state_for_the_gather():
    """EngineCore.has_running: False with only waiting requests, True once one is admitted."""
    from engine_helpers import model_dir

    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    from mstar.runtime.engine.request import EngineRequest, SamplingParams
    core = EngineCore(EngineConfig(model=model_dir("qwen3.5"), device="cpu", dtype="float32", max_num_seqs=4,
                                   max_model_len=64))
    assert not core.has_unfinished() and not core.has_running()
    core.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
    assert core.has_unfinished() and not core.has_running()
    core.step()
    assert core.has_running()
    while core.has_unfinished():
        core.step()
    assert not core.has_running()


# --- MSTAR_REFILL_GATHER_US: requests owed by closed-loop clients ---------------------------------
def _adds(*names):
    return [("add", [n]) for n in names]


def test_refill_waits_for_a_finished_waves_clients_and_no_longer():
    from mstar.runtime.engine.engine_process import RefillGather
    refill = RefillGather(1.0)
    refill.finished(3, time.monotonic())  # three requests ended in one step, nothing runs
    q = queue.Queue()
    t = _feed(q, _adds("a", "b", "c", "d"), 0.02)  # their clients' next ones, 20 ms apart, then another
    cmds = []
    t0 = time.monotonic()
    take_commands(q, cmds, busy=False, refill=refill)
    waited = time.monotonic() - t0
    assert cmds[:3] == _adds("a", "b", "c") and refill.owed == 0
    assert waited < 0.5  # returned once the three came, not at the window's end
    t.join()


def test_refill_a_lone_client_waits_nothing():
    from mstar.runtime.engine.engine_process import RefillGather
    refill = RefillGather(1.0)
    refill.finished(1, time.monotonic())
    q = queue.Queue()
    t = _feed(q, _adds("a", "b"), 0.3)
    cmds = []
    take_commands(q, cmds, busy=False, refill=refill)
    assert cmds == _adds("a")  # its one request settles it: b (another client) is the next step's
    t.join()


def test_refill_window_bounds_the_wait_and_then_expires():
    from mstar.runtime.engine.engine_process import RefillGather
    refill = RefillGather(0.05)
    refill.finished(4, time.monotonic())
    q = queue.Queue()
    t = _feed(q, _adds("a", "b"), 0.3)  # one client comes back; the others never do in time
    cmds = []
    t0 = time.monotonic()
    take_commands(q, cmds, busy=False, refill=refill)
    assert cmds == _adds("a") and time.monotonic() - t0 < 0.25
    t.join()
    assert refill.deadline(time.monotonic()) == 0.0  # the window is over: b waits nothing
    refill.finished(1, time.monotonic())  # a new finish after the window starts afresh
    assert refill.owed == 1


def test_refill_never_holds_a_running_engine_and_ignores_aborts():
    from mstar.runtime.engine.engine_process import RefillGather
    refill = RefillGather(1.0)
    refill.finished(2, time.monotonic())
    q = queue.Queue()
    t = _feed(q, [("abort", ["x"])] + _adds("a", "b"), 0.05)
    time.sleep(0.01)
    cmds = []
    t0 = time.monotonic()
    take_commands(q, cmds, busy=True, running=True, refill=refill)  # rows decoding: what is there only
    assert cmds == [("abort", ["x"])] and refill.owed == 2 and time.monotonic() - t0 < 0.04
    t.join()


def test_refill_is_on_by_default_and_off_at_zero():
    from mstar.runtime.engine.engine_process import RefillGather
    assert knobs.value("MSTAR_REFILL_GATHER_US") == 10000
    off = RefillGather(knobs.parse_environment({"MSTAR_REFILL_GATHER_US": "0"})["MSTAR_REFILL_GATHER_US"] / 1e6)
    off.finished(8, time.monotonic())
    assert off.owed == 0 and off.deadline(time.monotonic()) == 0.0
