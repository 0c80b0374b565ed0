"""How the stage engine drives a DecodeLoopStage (interfaces.py): an open-ended, continuous loop.

One engine step, for such a stage:
  1. every running batch: its aborted rows leave (their outputs discarded), then waiting requests
     of its key join it (up to max_batch);
  2. every running batch takes one step; each row's outputs go out at once (the last stage: a
     CoreOutput with media and no finish) or are kept for the next stage; rows that are done
     leave, and move on (the last stage: finished, with their last outputs);
  3. every key with requests waiting and no batch running starts a batch, with its first step.
A batch whose rows have all left is gone. An exception in a stage function fails that batch's
requests (a join's: the joining requests only).
"""

from __future__ import annotations

import time

from mstar.models import interfaces as I
from mstar.runtime.engine.request import CoreOutput


class DecodeLoopDriver:
    """StageEngine's part for DecodeLoopStages (it shares the engine's queues and batches)."""

    def _decode_loop(self, k: int, stage: I.DecodeLoopStage, outputs: list, trace: list) -> None:
        running, waiting = self._running[k], self._waiting[k]
        for b in list(running):
            self._drop_aborted(k, stage, b, outputs, trace)
            if b in running and b.key in waiting and len(b.reqs) < stage.max_batch:
                self._join(k, stage, b, outputs, trace)
        for b in list(running):
            self._decode_step(k, stage, b, outputs, trace)
        busy = {b.key for b in running}
        for key in [kk for kk in waiting if kk not in busy]:
            batch = self._take(k, key, stage.max_batch)
            trace.append((k, "start", key, len(batch)))
            t0 = time.perf_counter()
            try:
                state = stage.start([r.media for r in batch])
            except Exception as e:  # noqa: BLE001
                self._fail(k, batch, e, outputs)
                continue
            finally:
                self._account(k, len(batch), t0)
            b = self._new_batch(k, key, batch, state)
            running.append(b)
            self._decode_step(k, stage, b, outputs, trace)

    def _decode_step(self, k: int, stage: I.DecodeLoopStage, b, outputs: list, trace: list) -> None:
        running = self._running[k]
        last = k == len(self.stages) - 1
        t0 = time.perf_counter()
        try:
            trace.append((k, "step", b.key, len(b.reqs)))
            b.state, rows = stage.step(b.state)
            if not isinstance(rows, (list, tuple)) or len(rows) != len(b.reqs):
                got = len(rows) if isinstance(rows, (list, tuple)) else type(rows).__name__
                raise TypeError(f"the stage's step returned {got} rows for {len(b.reqs)} requests")
            b.i += 1
            done = []
            for j, (q, (outs, ended)) in enumerate(zip(b.reqs, rows)):
                if outs and self._reqs.get(q.rid) is q:
                    if last:
                        outputs.append(CoreOutput(q.rid, [], None, media=list(outs)))
                    else:
                        q.collected.extend(outs)
                if ended:
                    done.append(j)
            if done:
                trace.append((k, "leave", b.key, len(done)))
                reqs, results = self._leave(stage, b, done)
                results = [q.collected + list(outs) for q, outs in zip(reqs, results)]
                for q in reqs:
                    q.collected = []
                self._advance(k, reqs, results, outputs)
            if not b.reqs:
                running.remove(b)
                b.state = None
                trace.append((k, "finish", b.key, 0))
        except Exception as e:  # noqa: BLE001
            if b in running:
                running.remove(b)
            b.state = None
            self._fail(k, b.reqs, e, outputs)
        finally:
            self.stage_seconds[k] += time.perf_counter() - t0


__all__ = ["DecodeLoopDriver"]
