"""A server the benchmarks launch themselves: `python -m mstar.runtime.serve MODEL --port 0`
(random weights unless MODEL is a directory), its output in a log file, ready once the log says
it serves.

    with LocalServer("whisper-large-v3", ["--max-num-seqs", "16"], timeout=900) as s:
        s.url          # http://127.0.0.1:PORT
        s.ready_s      # launch -> "mstar is serving" seen in the log
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVING = re.compile(r"mstar is serving \S+ at (http://\S+) \(ready in ([\d.]+) s\)")


class LocalServer:
    def __init__(self, model: str, server_args: list[str] = (), *, timeout: float = 900.0, log_path: str | None = None,
                 env: dict[str, str] | None = None):
        """Launch and wait until it serves (RuntimeError with the log's tail if it exits or times out
        first). log_path: keep the output there; default a temporary file, removed by close()."""
        self.keep = log_path is not None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="mstar-bench-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        cmd = [sys.executable, "-m", "mstar.runtime.serve", model, "--port", "0", "--no-access-log"]
        if not os.path.isdir(model):
            cmd.append("--random-weights")
        cmd += list(server_args)
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
        with open(log_path, "w") as log:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = t0 + timeout
        while True:
            text = self.log()
            m = SERVING.search(text)
            if m:
                self.url, self.ready_s, self.launched_at = m.group(1), time.perf_counter() - t0, t0
                return
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                self.close(keep_log=True)
                raise RuntimeError(f"the server did not start (log {log_path}):\n{text[-3000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def close(self, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not (self.keep or keep_log):
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
