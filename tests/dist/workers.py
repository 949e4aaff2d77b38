"""Worker processes for multi-rank model tests: `python <script> spec root rank world store` per
rank, each logging to root/rank<r>.log, with a bounded join and no process left behind."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).parents[2]


class Workers:
    def __init__(self, script: str, spec: pathlib.Path, root: pathlib.Path, world: int):
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1"}
        self.procs, self.logs = [], []
        for r in range(world):
            log = open(root / f"rank{r}.log", "w+")
            self.logs.append(log)
            self.procs.append(subprocess.Popen([sys.executable, str(ROOT / script), str(spec), str(root), str(r),
                                               str(world), str(root / "store")],
                                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))

    def __enter__(self) -> "Workers":
        return self

    def join(self, timeout_s: float) -> list[str]:
        """Wait for every rank (one deadline for all); assert each exited 0; return their logs."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        outputs = []
        for r, (p, log) in enumerate(zip(self.procs, self.logs)):
            log.seek(0)
            outputs.append(log.read())
            assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{outputs[-1][-4000:]}"
        return outputs

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for log in self.logs:
            log.close()
