"""Run a test script under Triton's CPU interpreter (TRITON_INTERPRET=1 must be set before
Triton defines the kernels, hence a subprocess). The script prints one JSON line last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The interpreter keeps bfloat16 as its raw 16 bits (uint16) and its tl.dot multiplies those
# integers: widen bfloat16 operands to float32 first (exact), as the GPU's product does.
#
# The interpreter turns a scalar argument into a one-element array, and its loop bounds call
# int() on it, which numpy >= 2.3 refuses for arrays of one dimension: a kernel with a
# `range(0, K, BLOCK)` loop fails under the interpreter alone. Read the element instead.
_PRELUDE = """
import triton.runtime.interpreter as _interp
_patch_tensor = _interp._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_interp._patch_lang_tensor = _patch_lang_tensor

import numpy as _np
import triton.language as _tl
_create_dot = _interp.InterpreterBuilder.create_dot
def _widened(h):
    if h.dtype.scalar != _tl.bfloat16:
        return h
    return _interp.TensorHandle((h.data.astype(_np.uint32) << 16).view(_np.float32), _tl.float32)
def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _create_dot(self, _widened(a), _widened(b), d, input_precision, max_num_imprecise_acc)
_interp.InterpreterBuilder.create_dot = _create_dot_bf16
"""


def run_interpreted(script: str):
    """Triton is a dev dependency (pyproject.toml): no skip when it is missing."""
    script = _PRELUDE + script
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
