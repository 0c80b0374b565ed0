"""A real `python -m mstar.runtime.serve` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
_READY = re.compile(r"mstar is serving \S+ at (http://\S+) ")
_ENGINE_PID = re.compile(r"engine (?:ready in \S+ s|restarted) \(pid (\d+)")


def toy_families_env() -> dict:
    """The environment of a server of the test families (toy-speech, toy-image: toy_stages.py,
    loaded as a model plugin)."""
    return {"MSTAR_MODEL_PLUGINS": "synthetic_families",
            "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}


class ServerProc:
    def __init__(self, *args: str, startup_timeout: float = 180.0, env: dict | None = None):
        """env: variables set for the server beside this process's (a PYTHONPATH there goes after
        the checkout)."""
        self.args = ["--port", "0", "--no-access-log", *args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mstar-server-", suffix=".log", delete=False)
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "mstar.runtime.serving.serve", *self.args], cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.url = self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _READY.search(self.log_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        if body is not None:
            kw["json"] = body
        return httpx.post(self.url + path, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples by name; labelled ones as name{labels}."""
        out = {}
        for line in self.get("/metrics").text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Wait until the engine runs nothing and holds no KV page; the last metrics."""
        deadline = time.monotonic() + timeout
        m = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            if (m.get("mstar_num_requests_running") == 0 and m.get("mstar_num_requests_waiting") == 0
                    and m.get("mstar_kv_cache_pages_used") == 0 and m.get("mstar_num_requests_pending") == 0):
                return m
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout} s: "
                             f"{ {k: v for k, v in m.items() if 'num_requests' in k or 'pages' in k} }")

    @property
    def engine_pid(self) -> int:
        """The pid of the engine process now serving (the server logs it at start and restart;
        /health shows it only to a caller with the API key)."""
        pids = _ENGINE_PID.findall(self.log_text())
        assert pids, "no engine pid in the server log"
        return int(pids[-1])

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.terminate(30)
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


class BootingServer(ServerProc):
    """A ServerProc that does not wait for its server at construction (ready() does): several
    servers, or a server and the tests before it, start side by side."""

    def _wait_ready(self, timeout: float):
        self._timeout = timeout
        return None

    def ready(self) -> "BootingServer":
        if self.url is None:
            self.url = ServerProc._wait_ready(self, self._timeout)
        return self


def stop_all(servers) -> None:
    """SIGTERM every server, then wait for each: they drain side by side."""
    for p in servers:
        if p.proc.poll() is None:
            p.proc.terminate()
    for p in servers:
        p.close()
