"""Topology: the launcher's environment (Slurm, Open MPI, MPICH/PMI, torchrun), rack YAML files with
errors that name the bad field, built-in racks and racks from gathered hostnames."""
import pytest

from nvl72.topology import RACKS, TopologyError, launch_env, load_rack, rack_from_hostnames


def test_slurm_environment():
    env = launch_env({"SLURM_PROCID": "13", "SLURM_NTASKS": "72", "SLURM_LOCALID": "1", "SLURM_NODEID": "3",
                      "SLURM_TASKS_PER_NODE": "4(x18)"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 13, 72, 1, 4)


def test_slurm_uneven_tasks_per_node():
    env = launch_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "10", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                      "SLURM_TASKS_PER_NODE": "4(x2),2"})
    assert env.local_world_size == 2


def test_open_mpi_wins_over_the_slurm_allocation():
    env = launch_env({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                      "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("ompi", 5, 8, 1, 4)


def test_mpich_hydra_pmi():
    env = launch_env({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3",
                      "PMI_HOSTNAME": "hostA"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.hostname) == ("pmi", 2, 3, 2, "hostA")


def test_torchrun_and_single():
    env = launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (env.launcher, env.rank) == ("torchrun", 1)
    assert launch_env({}).launcher == "single"


@pytest.mark.parametrize("env,match", [
    ({"PMI_RANK": "x", "PMI_SIZE": "3"}, "PMI_RANK='x'"),
    ({"PMI_RANK": "3", "PMI_SIZE": "3"}, "PMI_RANK=3 is outside"),
    ({"PMI_RANK": "0"}, "PMI_SIZE is missing"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}, "OMPI_COMM_WORLD_SIZE=0"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "four"}, "SLURM_TASKS_PER_NODE='four'"),
])
def test_bad_environment_names_the_variable(env, match):
    with pytest.raises(TopologyError, match=match):
        launch_env(env)


def test_builtin_nvl72():
    rack = RACKS["nvl72"]
    assert rack.world_size == 72 and len(rack.nodes) == 18 and list(rack.domains()) == ["nvl0"]
    assert rack.fabric_handles and rack.multicast
    assert list(rack.node_ranks(17)) == [68, 69, 70, 71] and rack.node_of_rank(13) == 3


def test_yaml_rack(tmp_path):
    f = tmp_path / "two.yaml"
    f.write_text("gpu: GB200\ngpus_per_node: 4\nfabric_handles: true\nnodes:\n"
                 "  - a\n  - {name: b, domain: d1}\n  - {name: c, gpus: 2, domain: d1}\n")
    rack = load_rack(str(f))
    assert rack.name == "two" and rack.world_size == 10 and not rack.multicast
    assert rack.domains() == {"nvl0": [0], "d1": [1, 2]}
    f.write_text("gpu: H100\ngpus_per_node: 8\nnodes: 2\nname: pair\n")
    assert load_rack(str(f)).world_size == 16


@pytest.mark.parametrize("text,match", [
    ("gpu: GB200\ngpus_per_node: 4\nnodes: 2\ncolour: red\n", r"unknown field\(s\) \['colour'\]"),
    ("gpus_per_node: 4\nnodes: 2\n", "gpu: missing"),
    ("gpu: GB200\ngpus_per_node: four\nnodes: 2\n", "gpus_per_node: expected a positive integer, got 'four'"),
    ("gpu: GB200\nnodes: 2\n", "gpus_per_node: required"),
    ("gpu: GB200\ngpus_per_node: 4\nnodes:\n  - {name: a, gpus: 0}\n", r"nodes\[0\]\.gpus: expected a positive"),
    ("gpu: GB200\ngpus_per_node: 4\nnodes:\n  - a\n  - {gpus: 4}\n", r"nodes\[1\]\.name: missing"),
    ("gpu: GB200\ngpus_per_node: 4\nnodes:\n  - a\n  - {name: b, nvswitch: 1}\n", r"nodes\[1\]: unknown field"),
    ("gpu: GB200\ngpus_per_node: 4\nnodes: [a, a]\n", "duplicate node name"),
    ("gpu: GB200\ngpus_per_node: 4\nmulticast: yes please\nnodes: 1\n", "multicast: expected true or false"),
    ("gpu: GB200\ngpus_per_node: 4\nnodes: []\n", "nodes: expected a positive count or a non-empty list"),
    ("- just\n- a list\n", "expected a mapping"),
])
def test_bad_yaml_names_the_field(tmp_path, text, match):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(TopologyError, match=match) as e:
        load_rack(str(f))
    assert "bad.yaml" in str(e.value)


def test_unknown_rack_spec():
    with pytest.raises(TopologyError, match="'nvl36x'"):
        load_rack("nvl36x")


def test_cpu_racks():
    assert load_rack("cpu:3").world_size == 3
    rack = load_rack("cpu:2x4")
    assert len(rack.nodes) == 2 and rack.world_size == 8 and rack.gpu == "cpu"


def test_rack_from_hostnames():
    rack = rack_from_hostnames(["h0", "h0", "h1", "h1"], "GB200", ["nvlA"] * 2 + ["nvlB"] * 2)
    assert [(n.name, n.gpus, n.domain) for n in rack.nodes] == [("h0", 2, "nvlA"), ("h1", 2, "nvlB")]
    with pytest.raises(TopologyError, match="rank 2 is on host 'h0' again"):
        rack_from_hostnames(["h0", "h1", "h0"], "cpu")
    with pytest.raises(TopologyError, match="rank 1 on host 'h0' reports NVLink domain 'b'"):
        rack_from_hostnames(["h0", "h0"], "cpu", ["a", "b"])
