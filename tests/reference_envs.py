"""Reference packages that pin other versions of the project's dependencies (qwen-tts pins
transformers 4.57; Cosmos3's pipeline needs a newer diffusers than the Wan tests compare with),
each in its own virtual environment, built once by the tests and cached.

    env = reference_env("qwen-tts")        # the environment's python, built on first use
    out = run_reference(env, SCRIPT, {"dir": str(tmp_path)})   # SCRIPT reads ARGS, sets RESULT

The environments see the system's site-packages (torch, numpy, safetensors: no second torch) and
install only what differs over them. They live under $MSTAR_TEST_ENVS (default
~/.cache/mstar/test-envs); a file lock lets parallel test processes share one build.

A script runs in a fresh interpreter of that environment: `ARGS` (a dict, from JSON) is defined
before it runs, and whatever it assigns to `RESULT` comes back (through torch.save, so tensors
travel exactly). Its stderr is shown when it fails.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import venv

import torch

# name -> (pip requirements installed with their dependencies, requirements installed --no-deps,
#          a preamble run before every script)
_QWEN_TTS_PREAMBLE = '''
# qwen_tts imports its 25 Hz tokenizer (which needs torchaudio's kaldi features) at package import;
# the 12 Hz model and tokenizer compared here never call it, and no torchaudio matches this torch
import importlib.machinery, sys, types
def _stub(name):
    m = types.ModuleType(name); m.__spec__ = importlib.machinery.ModuleSpec(name, None); sys.modules[name] = m
    return m
_ta = _stub("torchaudio"); _ta.compliance = _stub("torchaudio.compliance")
_ta.compliance.kaldi = _stub("torchaudio.compliance.kaldi")
'''

ENVS: dict[str, tuple[list[str], list[str], str]] = {
    "qwen-tts": (["transformers==4.57.3", "accelerate==1.12.0", "einops", "librosa", "soundfile", "sox",
                  "onnxruntime"], ["qwen-tts==0.1.1"], _QWEN_TTS_PREAMBLE),
    "diffusers-0.42": (["diffusers==0.42.1"], [], ""),
}


def _root() -> str:
    return os.environ.get("MSTAR_TEST_ENVS") or os.path.join(os.path.expanduser("~"), ".cache", "mstar", "test-envs")


def reference_env(name: str) -> str:
    """The python executable of environment `name` (ENVS), built if it is not there yet."""
    reqs, no_deps, _ = ENVS[name]
    tag = "-".join([name, f"py{sys.version_info.major}{sys.version_info.minor}"])
    path = os.path.join(_root(), tag)
    python = os.path.join(path, "bin", "python")
    stamp = os.path.join(path, ".built")
    want = json.dumps([reqs, no_deps])
    os.makedirs(_root(), exist_ok=True)
    with open(os.path.join(_root(), tag + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(stamp) and open(stamp).read() == want:
            return python
        venv.EnvBuilder(system_site_packages=True, clear=True, with_pip=True).create(path)
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        if reqs:
            subprocess.run(pip + reqs, check=True)
        if no_deps:
            subprocess.run(pip + ["--no-deps"] + no_deps, check=True)
        with open(stamp, "w") as f:
            f.write(want)
    return python


def run_reference(python: str, script: str, args: dict | None = None, *, env_name: str | None = None,
                  timeout: float = 900):
    """Run `script` in that environment's interpreter with ARGS = args; returns its RESULT."""
    name = env_name or next((n for n in ENVS if f"{os.sep}{n}-py" in python), None)
    preamble = ENVS[name][2] if name else ""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        body = "\n".join([
            "import json, sys, torch",
            textwrap.dedent(preamble),
            f"ARGS = json.loads({json.dumps(json.dumps(args or {}))})",
            "RESULT = None",
            textwrap.dedent(script),
            f"torch.save(RESULT, {out!r})",
        ])
        path = os.path.join(tmp, "reference.py")
        with open(path, "w") as f:
            f.write(body)
        # the checkout must not shadow the environment's packages (its own transformers pin)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        p = subprocess.run([python, path], cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"the reference script failed ({p.returncode}):\n{p.stderr[-6000:]}")
        return torch.load(out, weights_only=False)
