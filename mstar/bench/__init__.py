"""mstar's benchmarks, in one place (how they measure: notes/benchmarks.md).

    mstar bench serve | whisper | speech | video | images | offline | gate | gate-model
                                                               the clients (python -m mstar.bench.NAME)
    mstar bench ops [pytest args]                              the op benchmarks (mstar/bench/ops, pytest)
    python -m mstar.bench.tools.NAME                           probes and profilers (mstar/bench/tools)
"""

import json
import os


def append_jsonl(path: str, *records: dict) -> None:
    """Append records to a JSON-lines file (its folder made): each point is written as soon as it
    is measured, so a run killed later keeps what it measured."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
