"""`pytest mstar/bench/ops` (or `mstar bench ops`): op benchmarks. Prints a table at the end and
writes a JSON result file (--ops-json, default .benchmarks/ops-<device>.json)."""

from __future__ import annotations

import datetime
import json
import os

import torch

from mstar.bench.ops.cases import ROWS, device
from mstar.bench.serve import git_commit


def pytest_addoption(parser):
    parser.addoption("--ops-json", default=None, help="where to write the op benchmark rows (JSON)")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not ROWS:
        return
    dev = device()
    tr = terminalreporter
    tr.section(f"mstar op benchmarks ({dev})")
    head = f"{'op':24} {'case':36} {'backend':12} {'mode':5} {'median_us':>10} {'GB/s':>9} {'TFLOP/s':>8}"
    if dev == "cuda":
        head += f" {'%bw':>6} {'%flop':>6}"
    tr.write_line(head)
    for r in ROWS:
        line = (f"{r['op']:24} {r['case']:36} {r['backend']:12} {r['mode']:5} {r['median_us']:10.1f} {r['gb_s']:9.2f} "
                f"{r['tflop_s']:8.3f}")
        if dev == "cuda":
            line += f" {100 * r['frac_bw']:6.1f} {100 * r['frac_flops']:6.1f}"
        tr.write_line(line)
    path = config.getoption("--ops-json") or f".benchmarks/ops-{dev}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
            "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": ROWS}, f, indent=1)
    tr.write_line(f"rows written to {path}")


def pytest_configure(config):
    # pytest-benchmark's own table: keep it short; ours (below it) has the rates
    if hasattr(config.option, "benchmark_columns"):
        config.option.benchmark_columns = ["median", "iqr", "rounds"]
        config.option.benchmark_sort = "name"
