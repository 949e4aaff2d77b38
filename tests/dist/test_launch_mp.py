"""`python -m launch` under `mpiexec -n 3` on CPU: roles come up, report readiness to the front,
heartbeat, and all exit cleanly within a bound after a shutdown message."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from nvl72.commands.launch import request_shutdown

SMALL = ["--rack", "cpu:3", "--model", "Qwen3-30B-A3B", "--prefill-tp", "2", "--decode-size", "1",
         "--prefill-instances", "1", "--decode-instances", "1"]


def _mpiexec() -> str:
    exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        pytest.skip("mpiexec (the mpich package) is not installed")
    return exe


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}


def _wait_for(path: pathlib.Path, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    out, err = proc.communicate(timeout=30)
    pytest.fail(f"no readiness within {timeout}s (rc {proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}")


@pytest.mark.mp
def test_launch_brings_up_roles_and_shuts_down_on_request(tmp_path):
    plan = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "nvl72", "plan", *SMALL, "--out", str(plan)], check=True, timeout=60,
                   capture_output=True)
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([_mpiexec(), "-n", "3", sys.executable, "-m", "launch", "--plan", str(plan),
                             "--ready-file", str(ready), "--heartbeat", "0.2", "--timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        info = _wait_for(ready, proc, timeout=120)
        ranks = {r["rank"]: r for r in info["ranks"]}
        assert sorted(ranks) == [0, 1, 2]
        assert [ranks[r]["instance"] for r in range(3)] == ["prefill[0]", "prefill[0]", "decode[0]"]
        assert [ranks[r]["tp"] for r in range(3)] == [[0, 2], [1, 2], [0, 1]]
        # The prefill TP group really carries an all-reduce over both ranks.
        assert ranks[0]["group_sums"] == ranks[1]["group_sums"] == {"instance": 2, "tp": 2, "ep": 2}
        assert len({r["pid"] for r in info["ranks"]}) == 3
        time.sleep(1.0)  # a few heartbeats go by; nobody is declared lost
        assert proc.poll() is None
        t0 = time.monotonic()
        request_shutdown(info["front"], reason="test")
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-4000:]
    assert took < 30, f"shutdown took {took:.1f}s"
    assert "all 3 ranks ready" in err
    assert err.count("leaving (test)") == 3


@pytest.mark.mp
def test_launch_plans_on_every_rank_and_stops_after_run_seconds(tmp_path):
    ready = tmp_path / "ready.json"
    gathered = SMALL[2:]  # no --rack: the rack is the hosts the ranks report
    out = subprocess.run([_mpiexec(), "-n", "3", sys.executable, "-m", "launch", *gathered, "--ready-file", str(ready),
                          "--run-seconds", "0", "--heartbeat", "0.2", "--timeout", "60"],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(ready.read_text())["world_size"] == 3
    assert out.stderr.count("leaving (--run-seconds 0 elapsed)") == 3
    assert "rack launch: 1 nodes x 3 cpu = 3 ranks" in out.stderr


def test_launch_rejects_a_plan_for_another_world_size():
    out = subprocess.run([sys.executable, "-m", "launch", *SMALL], capture_output=True, text=True, timeout=60,
                         env=_env())
    assert out.returncode == 2, out.stderr[-3000:]
    assert "has 3 ranks but the launcher started 1" in out.stderr


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.mp
def test_launch_on_gpus_with_nccl(tmp_path):
    """Two GPUs under torchrun: the rack comes from the gathered hostnames, a DP2/EP2 decode instance's
    NCCL group carries an all-reduce, readiness and shutdown as on CPU."""
    root = pathlib.Path(__file__).resolve().parents[2]
    ready = tmp_path / "ready.json"
    env = {**_env(), "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "launch",
                          "--device", "cuda", "--model", "Qwen3-30B-A3B", "--prefill-instances", "0",
                          "--decode-instances", "1", "--decode-size", "2", "--ready-file", str(ready),
                          "--run-seconds", "1", "--heartbeat", "0.2", "--timeout", "120"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = json.loads(ready.read_text())["ranks"]
    assert [r["device"] for r in ranks] == ["cuda", "cuda"]
    assert [r["group_sums"] for r in ranks] == [{"instance": 2, "ep": 2, "dp": 2}] * 2
    assert "H200" in out.stderr or "H100" in out.stderr or "B200" in out.stderr or "GB200" in out.stderr
