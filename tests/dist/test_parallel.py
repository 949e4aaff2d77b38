"""Rank bookkeeping and group lists from a plan; the world/control group in one process; the launch's
control messages; launch/srun.sh against a fake srun."""
import os
import pathlib
import subprocess
import sys

import pytest

from nvl72.commands.launch import HeartbeatAck, RankBye, RankReady, decode, encode
from nvl72.engine.protocol import LoadReport, ProtocolError, Shutdown
from nvl72.parallel import ParallelError, group_lists, rank_role, rendezvous
from nvl72.plan import MODELS, Workload, make_plan
from nvl72.topology import LaunchEnv, load_rack

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _plan(decode_tp=1):
    # 2 nodes x 4 CPU workers: one TP4 prefill node, one decode instance of 4 ranks.
    return make_plan(load_rack("cpu:2x4"), MODELS["Qwen3-30B-A3B"], Workload(0, 0), decode_size=4,
                     decode_tp=decode_tp, prefill_instances=1, decode_instances=1)


def test_rank_roles():
    plan = _plan()
    r = rank_role(plan, 2)
    assert (r.role, r.name, r.tp_rank, r.tp_size, r.ep_rank, r.ep_size, r.dp_size) == ("prefill", "prefill[0]", 2, 4, 2, 4, 1)
    r = rank_role(plan, 6)
    assert (r.role, r.tp_size, r.dp_rank, r.dp_size, r.ep_rank, r.ep_size) == ("decode", 1, 2, 4, 2, 4)


def test_decode_tp2_groups():
    plan = _plan(decode_tp=2)
    lists = group_lists(plan)
    assert lists["instance"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lists["decode_tp"] == [[4, 5], [6, 7]]
    assert lists["decode_dp"] == [[4, 6], [5, 7]]
    r = rank_role(plan, 7)
    assert (r.tp_rank, r.tp_size, r.dp_rank, r.dp_size, r.ep_rank) == (1, 2, 1, 2, 3)


def test_spare_ranks():
    plan = make_plan(load_rack("cpu:2x4"), MODELS["Qwen3-30B-A3B"], Workload(0, 0), prefill_instances=1,
                     decode_instances=0, decode_size=4)
    assert plan.spare_ranks() == [4, 5, 6, 7]
    assert rank_role(plan, 5).role == "spare"


def test_rendezvous_from_environment():
    env = LaunchEnv("slurm", 1, 8, 1, 4, "h")
    assert rendezvous(env, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == ("10.0.0.1", 29500)
    with pytest.raises(ParallelError, match="MASTER_PORT='x'"):
        rendezvous(env, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "x"})
    with pytest.raises(ParallelError, match="set MASTER_ADDR"):
        rendezvous(env, {})


def test_control_messages_round_trip():
    for msg in (RankReady(3, "decode", "decode[0]", "h", 7, "cpu", [0, 1], [3, 16], [3, 16], {"ep": 16}),
                Shutdown("operator"), RankBye(2), HeartbeatAck(1.5), LoadReport(1, 2, 3, 0.5, 9.0)):
        assert decode(encode(msg)) == msg
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(b"\xc1")
    import msgpack

    with pytest.raises(ProtocolError, match="version 99"):
        decode(msgpack.packb({"v": 99, "kind": "shutdown", "body": {"reason": "x"}}))
    with pytest.raises(ProtocolError, match="bad fields for 'rank_bye'"):
        decode(msgpack.packb({"v": 1, "kind": "rank_bye", "body": {"rnak": 1}}))


def test_srun_script_with_a_fake_slurm(tmp_path):
    """launch/srun.sh: rendezvous on the allocation's first node, one task per GPU, `python -m launch`."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text('#!/bin/sh\nprintf "gpu-a01\\ngpu-a02\\n"\n')
    (bin_ / "srun").write_text('#!/bin/sh\necho "MASTER=$MASTER_ADDR:$MASTER_PORT ARGS=$*"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4"}
    out = subprocess.run(["bash", str(ROOT / "launch" / "srun.sh"), "--plan", "p.json"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "MASTER=gpu-a01:24242" in out.stdout
    assert "--nodes=2 --ntasks-per-node=4 --kill-on-bad-exit=1 python -m launch --plan p.json" in out.stdout
    out = subprocess.run(["bash", str(ROOT / "launch" / "srun.sh")], env={"PATH": os.environ["PATH"]},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "SLURM_JOB_ID" in out.stderr


def test_local_fabric_on_cpu(monkeypatch):
    from nvl72.commands.launch import local_fabric

    monkeypatch.delenv("NVL72_NVLINK_DOMAIN", raising=False)
    assert local_fabric("cpu", 0, "hostA") == ("hostA", False, False)  # a host is its own domain
    monkeypatch.setenv("NVL72_NVLINK_DOMAIN", "rack7")
    assert local_fabric("cpu", 0, "hostA") == ("rack7", False, False)


def test_python_m_launch_help():
    out = subprocess.run([sys.executable, "-m", "launch", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--ready-file" in out.stdout and "--plan" in out.stdout
