"""Speech requests through an Orpheus engine (tests/test_orpheus.py, tests/test_orpheus_gpu.py):
build one, run requests to the end, collect tokens and audio."""

from __future__ import annotations

import numpy as np

from mstar.models import interfaces as I
from mstar.runtime.engine.request import EngineRequest


def speech(rid: str, text: str, seed: int, n: int, voice: str = "tara") -> EngineRequest:
    return EngineRequest(rid, [], None, media=I.MediaRequest(rid, {"text": text, "voice": voice,
                                                                    "max_new_tokens": n}, seed))


def run(engine, reqs, abort_after: dict | None = None) -> dict:
    """Every request's tokens, audio chunks and finish reason; abort_after {rid: steps}."""
    for r in reqs:
        engine.add_request(r)
    out = {r.request_id: {"tokens": [], "chunks": [], "finish": None} for r in reqs}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for rid, at in (abort_after or {}).items():
            if at == steps:
                engine.abort(rid)
        for o in engine.step():
            d = out[o.request_id]
            d["tokens"] += o.new_token_ids
            d["chunks"] += [c for c in (o.media or ()) if isinstance(c, I.AudioChunk)]
            if o.finish_reason is not None:
                d["finish"] = o.finish_reason
    return out


def audio(d) -> np.ndarray:
    return np.concatenate([c.pcm for c in d["chunks"]]) if d["chunks"] else np.zeros(0, np.float32)
