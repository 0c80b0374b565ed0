"""The `mstar` entry point: `mstar serve MODEL` as vLLM and SGLang take it, `--version`, the tools
under one name, and argument mistakes reported in one line before any engine starts."""

from __future__ import annotations

import logging

import pytest

from mstar import cli
from mstar.runtime.serving import serve


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if serve.main gets as far as starting an engine process."""
    import mstar.runtime.engine.engine_process as ep

    def refuse(*a, **kw):
        raise AssertionError("an engine process was started")

    monkeypatch.setattr(ep, "EngineProcess", refuse)


def test_version(capsys):
    import mstar
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mstar {mstar.__version__}"


def test_model_positional_or_flag():
    assert serve.parse_args(["qwen3.5-0.8b"]).model == "qwen3.5-0.8b"
    assert serve.parse_args(["--model", "qwen3.5-0.8b"]).model == "qwen3.5-0.8b"
    assert serve.parse_args(["qwen3-0.6b", "--model", "qwen3-0.6b"]).model == "qwen3-0.6b"
    assert serve.parse_args([]).model == serve.DEFAULT_MODEL
    with pytest.raises(SystemExit) as e:
        serve.parse_args(["qwen3-0.6b", "--model", "qwen3.5-0.8b"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv,needle", [
    (["/no/such/checkpoint"], "model: '/no/such/checkpoint' is neither a model directory (no such directory)"),
    (["no-such-preset"], "nor a preset"),
    (["qwen3.5-0.8b"], "--random-weights"),
    (["--device", "cuda"], "no CUDA device is visible"),
    (["--device", "gpu7"], "is not a device"),
])
def test_argument_mistakes_are_one_line_before_the_engine(argv, needle, no_engine, caplog):
    import torch
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("CUDA is visible here")
    with caplog.at_level(logging.ERROR, logger="mstar.serve"):
        assert serve.main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and needle in errors[0] and "\n" not in errors[0], errors


def test_main_puts_the_signal_handlers_back(no_engine):
    """serve.main sets SIGTERM / SIGINT handlers that stop its start-up; once it returns, the
    caller's are back (a test process keeps its own: with serve's left in place, a SIGTERM to
    pytest raised inside whatever test ran next and pytest went on)."""
    import signal

    def mine(signum, frame):
        pass

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for s in saved:
            signal.signal(s, mine)
        assert serve.main(["no-such-preset"]) == 2
        assert all(signal.getsignal(s) is mine for s in saved)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_config_mistakes_are_one_line_and_stop_the_engine(monkeypatch, caplog):
    """A mistake only the model's config shows (--tp that does not divide its heads) is found while
    the engine process starts: one line, and that engine is stopped."""
    import mstar.runtime.engine.engine_process as ep
    events = []

    class FakeEngine:
        def __init__(self, config, factory=None):
            events.append("made")

        def start(self):
            events.append("started")

        def kill(self):
            events.append("killed")

        def wait_ready(self, timeout=None):
            raise AssertionError("the server waited for an engine it should have stopped")

    monkeypatch.setattr(ep, "EngineProcess", FakeEngine)
    with caplog.at_level(logging.ERROR, logger="mstar.serve"):
        assert serve.main(["--tp", "3"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "tp: tensor parallel size 3 must divide" in errors[0], errors
    assert events == ["made", "started", "killed"]


def test_preset_with_random_weights_passes_the_checks():
    from mstar.runtime.serving.preflight import check_serve
    check_serve("qwen3.5-0.8b", True, "cpu", 1)
    check_serve("qwen3.5-0.8b", True, "auto", 2)  # 2 divides every head count of the 0.8B shape


def test_tools_under_one_name(capsys):
    assert cli.main(["models", "list"]) == 0
    assert "qwen3.5-0.8b" in capsys.readouterr().out
    assert cli.main(["knobs"]) == 0
    assert "MSTAR_API_KEY" in capsys.readouterr().out
    assert cli.main(["bench", "nonsense"]) == 2
    assert cli.main(["bench", "serve", "--help"]) == 0
    assert "--base-url" in capsys.readouterr().out
    assert cli.main(["nonsense"]) == 2


def test_bench_ops_runs_pytest_on_the_installed_op_benchmarks(tmp_path):
    """`mstar bench ops ARGS` is pytest on mstar/bench/ops with ARGS passed through (any working directory)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "mstar.cli", "bench", "ops", "--collect-only", "-q",
                        "-k", "rms_norm and qwen3.5-0.8b_decode_bs1 and reference"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "test_ops.py::test_op[rms_norm-qwen3.5-0.8b_decode_bs1-reference]" in r.stdout
