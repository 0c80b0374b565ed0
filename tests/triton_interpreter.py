"""Run a test script under Triton's CPU interpreter (TRITON_INTERPRET=1 must be set before
Triton defines the kernels, hence a subprocess). The script prints one JSON line last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(script: str):
    """Triton is a dev dependency (pyproject.toml): no skip when it is missing."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
