"""The `mstar` console script: one entry point for the server and the tools.

    mstar serve [MODEL] [flags]   the OpenAI-compatible server (python -m mstar.runtime.serve)
    mstar models ...              presets, configs, memory plans (python -m mstar.models)
    mstar ops                     the ops, their backends and what loaded (python -m mstar.ops)
    mstar cache ...               the on-disk kernel caches (python -m mstar.ops.cache)
    mstar knobs ...               the MSTAR_* knobs (python -m mstar.runtime.knobs)
    mstar bench NAME ...          benchmarks: serve, startup, whisper, speech, video, images, offline, gate,
                                  gate-model, ops (pytest on mstar/bench/ops)
    mstar --version
"""

from __future__ import annotations

import runpy
import sys

# command -> the module whose `python -m` it stands for
_TOOLS = {
    "models": "mstar.models",
    "ops": "mstar.ops",
    "cache": "mstar.ops.cache",
    "knobs": "mstar.runtime.knobs",
}
_BENCHES = {
    "serve": "mstar.bench.serve",
    "startup": "mstar.bench.startup",
    "whisper": "mstar.bench.whisper",
    "speech": "mstar.bench.speech",
    "video": "mstar.bench.video",
    "images": "mstar.bench.images",
    "offline": "mstar.bench.offline",
    "gate": "mstar.bench.gate",
    "gate-model": "mstar.bench.gate_model",
    "ops": "mstar.bench.ops",  # the op benchmarks: pytest on that folder (_run_ops)
}

_USAGE = """usage: mstar <command> [flags]

commands:
  serve [MODEL]  serve a model over an OpenAI-compatible HTTP API (mstar serve --help)
  models         list presets, show a model's config, layers and per-GPU memory plan
  ops            the ops, their backends and the selection per device
  cache          build, list, export, import and clear the kernel caches
  knobs          the MSTAR_* settings, their defaults and meanings
  bench NAME     benchmarks: serve (an OpenAI server or HF generate), startup (launch to first token), whisper,
                 speech, video, images (Wan, with diffusers as the baseline), offline, gate, gate-model, ops (every
                 op and backend timed: pytest on the installed mstar/bench/ops, extra args passed on)
  --version      print mstar's version
"""


def _run_module(module: str, prog: str, argv: list[str]) -> int:
    """`python -m module argv...`, in this process; its exit status."""
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def _run_ops(argv: list[str]) -> int:
    """`mstar bench ops ARGS`: pytest on the installed op-benchmark folder, ARGS passed through."""
    import importlib.util
    import os
    if importlib.util.find_spec("pytest") is None or importlib.util.find_spec("pytest_benchmark") is None:
        print('mstar bench ops needs pytest and pytest-benchmark: pip install "mstar[dev]"', file=sys.stderr)
        return 2
    import pytest

    import mstar.bench.ops
    folder = os.path.dirname(os.path.abspath(mstar.bench.ops.__file__))
    return int(pytest.main([folder, "-p", "no:cacheprovider", *argv]))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_USAGE, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("--version", "-V", "version"):
        import mstar
        print(f"mstar {mstar.__version__}")
        return 0
    if cmd == "serve":
        from mstar.runtime.serving.serve import main as serve_main
        return serve_main(rest, prog="mstar serve")
    if cmd in ("bench-serve", "bench_serve"):  # the older spelling of `mstar bench serve`
        cmd, rest = "bench", ["serve", *rest]
    if cmd == "bench":
        if not rest or rest[0] not in _BENCHES:
            print(f"usage: mstar bench {{{','.join(_BENCHES)}}} [flags]", file=sys.stderr)
            return 2
        if rest[0] == "ops":
            return _run_ops(rest[1:])
        return _run_module(_BENCHES[rest[0]], f"mstar bench {rest[0]}", rest[1:])
    if cmd in _TOOLS:
        return _run_module(_TOOLS[cmd], f"mstar {cmd}", rest)
    print(f"mstar: unknown command {cmd!r}\n\n{_USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
