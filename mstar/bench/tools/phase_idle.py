#!/usr/bin/env python3
"""Summarise MSTAR_PHASE_TIMING records: p50 / p95 / mean per step phase and of the idle gap.

    MSTAR_PHASE_TIMING=1 MSTAR_PHASE_LOG=/tmp/phases.jsonl python -m mstar.runtime.serve ...
    python -m mstar.bench.tools.phase_idle /tmp/phases.jsonl
    python -m mstar.bench.tools.phase_idle /tmp/phases.jsonl --buckets 1,8,32,64,128 --by-run --skip 50

Input: JSON lines as written by mstar/runtime/engine/phase_timing.py, one per engine step
({"step", "decode", "prefill_tokens", "<phase>_us", ..., "idle_us"}); "run" header lines
and anything unparsable are skipped. Every "<name>_us" field is a phase. Two columns are
derived: step = the sum of the in-step phases (everything but idle*), and cycle = step +
idle where idle is known. idle is null after a step that left the engine without work
(the gap was waiting for requests); such steps count for the phases, not for idle.

Options:
  --buckets N,N,..   also split by batch size: decode rows, bucketed by upper bounds
                     (e.g. 1,8,32 -> <=1, 2-8, 9-32, >32); steps with prefill tokens form
                     their own "prefill"/"mixed" rows
  --by-run           one table per engine process (pid): a server that started in a slow
                     state shows a different idle p50 from one that did not
  --skip N           drop each run's first N steps (warm-up)
  --json             print the summary as JSON instead of tables
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections import defaultdict

IN_STEP_EXCLUDE = ("idle",)


def read_records(paths: list[str]) -> list[dict]:
    recs = []
    for path in paths:
        with contextlib.nullcontext(sys.stdin) if path == "-" else open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(d, dict) and "step" in d:
                    recs.append(d)
    return recs


def percentile(sorted_vals: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_vals:
        return math.nan
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def phase_names(recs: list[dict]) -> list[str]:
    names: dict[str, None] = {}
    for r in recs:
        for k in r:
            if k.endswith("_us"):
                names.setdefault(k[:-3], None)
    in_step = [n for n in names if not n.startswith(IN_STEP_EXCLUDE)]
    idle = [n for n in names if n.startswith(IN_STEP_EXCLUDE)]
    return in_step + ["step"] + idle + ["cycle"]


def summarise(recs: list[dict]) -> dict[str, dict[str, float]]:
    names = phase_names(recs)
    vals: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        step = 0.0
        for n in names:
            v = r.get(n + "_us")
            if isinstance(v, (int, float)):
                vals[n].append(float(v))
                if not n.startswith(IN_STEP_EXCLUDE):
                    step += float(v)
        vals["step"].append(step)
        idle = r.get("idle_us")
        if isinstance(idle, (int, float)):
            vals["cycle"].append(step + float(idle))
    out = {}
    for n in names:
        v = sorted(vals.get(n, []))
        out[n] = {"n": len(v), "p50": percentile(v, 50) if v else None,
                  "p95": percentile(v, 95) if v else None, "mean": sum(v) / len(v) if v else None}
    return out


def bucket_of(r: dict, bounds: list[int]) -> str:
    d = int(r.get("decode", 0) or 0)
    p = int(r.get("prefill_tokens", 0) or 0)
    if p:
        return "mixed" if d else "prefill"
    lo = 1
    for b in bounds:
        if d <= b:
            return f"decode {lo}-{b}" if lo != b else f"decode {b}"
        lo = b + 1
    return f"decode >{bounds[-1]}"


def format_table(title: str, summary: dict[str, dict[str, float]]) -> str:
    lines = [title, f"  {'phase':<14}{'n':>8}{'p50 us':>12}{'p95 us':>12}{'mean us':>12}"]
    for n, s in summary.items():
        cells = "".join(f"{'-':>12}" if s[k] is None else f"{s[k]:>12.1f}" for k in ("p50", "p95", "mean"))
        lines.append(f"  {n:<14}{s['n']:>8}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="phase_idle.py",
        description="Summarise MSTAR_PHASE_TIMING JSON lines: p50/p95/mean (microseconds) of each step "
                    "phase (schedule, prepare, plan, forward, logits, sample, output), their sum (step), "
                    "the idle gap between steps (idle, and its engine-process parts idle_drain / "
                    "idle_emit) and step + idle (cycle). Idle is counted only between steps with "
                    "work left, so it is loop overhead, not waiting for requests.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: MSTAR_PHASE_TIMING=1 MSTAR_PHASE_LOG=/tmp/p.jsonl mstar-serve ...; "
               "python -m mstar.bench.tools.phase_idle /tmp/p.jsonl --buckets 1,8,32,64,128 --by-run --skip 50")
    ap.add_argument("files", nargs="+", help="JSON-lines files written by MSTAR_PHASE_TIMING ('-': stdin)")
    ap.add_argument("--buckets", default="",
                    help="comma-separated upper bounds of decode batch-size buckets, e.g. 1,8,32,64,128; "
                         "steps with prefill tokens are reported as 'prefill' or 'mixed'")
    ap.add_argument("--by-run", action="store_true", help="one summary per engine process (pid)")
    ap.add_argument("--skip", type=int, default=0, help="drop each run's first N steps (warm-up)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)

    recs = read_records(args.files)
    if args.skip:
        seen: dict = defaultdict(int)
        kept = []
        for r in recs:
            key = r.get("pid")
            seen[key] += 1
            if seen[key] > args.skip:
                kept.append(r)
        recs = kept
    if not recs:
        print("no step records found", file=sys.stderr)
        return 1
    bounds = sorted({int(b) for b in args.buckets.split(",") if b.strip()}) if args.buckets else []

    groups: dict[str, list[dict]] = {}
    if args.by_run:
        for r in recs:
            groups.setdefault(f"run pid={r.get('pid')}", []).append(r)
    else:
        groups["all"] = recs

    result: dict = {}
    for gname, grecs in groups.items():
        entry = {"steps": len(grecs), "all": summarise(grecs)}
        if bounds:
            by_bucket: dict[str, list[dict]] = {}
            for r in grecs:
                by_bucket.setdefault(bucket_of(r, bounds), []).append(r)
            entry["buckets"] = {b: summarise(v) for b, v in sorted(by_bucket.items(), key=lambda kv: _bkey(kv[0]))}
        result[gname] = entry

    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    first = True
    for gname, entry in result.items():
        if not first:
            print()
        first = False
        print(format_table(f"{gname}: {entry['steps']} steps", entry["all"]))
        for b, s in entry.get("buckets", {}).items():
            print()
            print(format_table(f"{gname} / {b}: {s['step']['n']} steps", s))
    return 0


def _bkey(name: str):
    if name.startswith("decode >"):
        return (1, 10 ** 9)
    if name.startswith("decode "):
        return (0, int(name.split()[1].split("-")[0]))
    return (2, name)


if __name__ == "__main__":
    sys.exit(main())
