"""Server processes for the HTTP benchmarks (perf.serve_http, perf.disagg): started in their own
sessions so a whole process tree can be signalled, waited for with a bound, always reaped."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import httpx

from nvl72.commands.bench import BenchError


class Children:
    """Processes started in their own sessions, logging to files; all killed on exit."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env, self.procs = dict(os.environ if env is None else env), []

    def start(self, cmd: list[str], log: pathlib.Path, **env) -> subprocess.Popen:
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**self.env, **env},
                                 start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, timeout: float) -> list[int | None]:
        """SIGTERM every session, SIGKILL what is left after `timeout` seconds; exit codes."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        codes = [p.returncode for p in self.procs]
        self.procs = []
        return codes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop(8)


def wait_serving(url: str, procs: list[subprocess.Popen], logs: list[pathlib.Path], timeout: float) -> float:
    """Seconds until GET /health answers 200; BenchError with the logs' tails if a process exits or
    `timeout` passes first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and all(p.poll() is None for p in procs):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tails = "\n".join(f"--- {p}:\n" + p.read_text()[-3000:] for p in logs if p.exists())
    raise BenchError(f"{url} not serving within {timeout:g} s (exit codes {[p.poll() for p in procs]}):\n{tails}")
