"""The rack: nodes, GPUs per node, NVLink domains and fabric capabilities; and this process's place
in the launch (rank, world size, local rank) read from the launcher's environment.

A rack comes from one of three places:
  * a built-in name (`nvl72` = 18 nodes x 4 GB200 in one NVLink domain, `hgx-h100`, ... see RACKS);
  * a YAML file (schema below);
  * the launch itself: the hostnames of all ranks, gathered over the control group
    (`rack_from_hostnames`), one node per distinct host, in rank order.

YAML schema (unknown keys are errors; every error names the bad field):

    name: my-rack                 # optional, default: the file's stem
    gpu: GB200                    # GPU model, a key of plan_constants.json "hardware" (or "cpu")
    gpus_per_node: 4              # default GPU count of a node
    fabric_handles: true          # IMEX fabric handles: memory shareable across nodes of a domain
    multicast: true               # NVLink SHARP multicast (multimem) available
    nodes: 18                     # either a count (names node00.., all in domain "nvl0") ...
    nodes:                        # ... or a list of names or maps
      - node00
      - {name: node01, gpus: 4, domain: nvl0}

Ranks are numbered node-major: node i owns the ranks after those of nodes 0..i-1 (the block mapping
srun and mpirun use with --ntasks-per-node / -ppn).
"""
from __future__ import annotations

import os
import pathlib
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

import yaml


class TopologyError(ValueError):
    """A rack description or launcher environment that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Node:
    name: str
    gpus: int
    domain: str = "nvl0"  # NVLink domain (clique) the node's GPUs belong to


@dataclass(frozen=True)
class Rack:
    name: str
    gpu: str
    nodes: tuple[Node, ...]
    fabric_handles: bool = False
    multicast: bool = False

    def __post_init__(self):
        if not self.nodes:
            raise TopologyError(f"rack {self.name!r}: nodes: at least one node is required")
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise TopologyError(f"rack {self.name!r}: nodes: duplicate node name(s) {dup}")

    @property
    def world_size(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def node_ranks(self, node: int) -> range:
        """Global ranks of node `node` (node-major numbering)."""
        start = sum(n.gpus for n in self.nodes[:node])
        return range(start, start + self.nodes[node].gpus)

    def node_of_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside rack {self.name!r} of {self.world_size} ranks")
        for i in range(len(self.nodes)):
            if rank in self.node_ranks(i):
                return i
        raise AssertionError("unreachable")

    def domains(self) -> dict[str, list[int]]:
        """NVLink domain -> node indices, in node order."""
        out: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            out.setdefault(n.domain, []).append(i)
        return out

    def describe(self) -> str:
        doms = self.domains()
        sizes = sorted({n.gpus for n in self.nodes})
        per = str(sizes[0]) if len(sizes) == 1 else "/".join(map(str, sizes))
        return (
            f"rack {self.name}: {len(self.nodes)} nodes x {per} {self.gpu} = {self.world_size} ranks, "
            f"{len(doms)} NVLink domain(s), fabric handles {'yes' if self.fabric_handles else 'no'}, "
            f"multicast {'yes' if self.multicast else 'no'}"
        )


def _uniform(name: str, gpu: str, nodes: int, gpus: int, fabric: bool, multicast: bool) -> Rack:
    return Rack(name, gpu, tuple(Node(f"node{i:02d}", gpus) for i in range(nodes)), fabric, multicast)


# Built-in racks. NVL72: 18 compute trays x 4 Blackwell GPUs on one NVLink switch fabric, IMEX
# fabric handles and NVLink SHARP multicast. HGX: one 8-GPU node, POSIX fd handles, NVLS multicast.
RACKS: dict[str, Rack] = {
    "nvl72": _uniform("nvl72", "GB200", 18, 4, True, True),
    "hgx-h100": _uniform("hgx-h100", "H100", 1, 8, False, True),
    "hgx-h200": _uniform("hgx-h200", "H200", 1, 8, False, True),
    "hgx-b200": _uniform("hgx-b200", "B200", 1, 8, False, True),
}

_TOP_KEYS = {"name", "gpu", "gpus_per_node", "fabric_handles", "multicast", "nodes"}
_NODE_KEYS = {"name", "gpus", "domain"}


def _pos_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TopologyError(f"{where}: expected a positive integer, got {value!r}")
    return value


def _bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise TopologyError(f"{where}: expected true or false, got {value!r}")
    return value


def _str(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TopologyError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def rack_from_dict(data, name: str, where: str = "rack") -> Rack:
    """Build a Rack from the YAML schema above; `where` prefixes error messages (the file name)."""
    if not isinstance(data, Mapping):
        raise TopologyError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise TopologyError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(_TOP_KEYS)}")
    if "gpu" not in data:
        raise TopologyError(f"{where}: gpu: missing (e.g. GB200, H100, cpu)")
    gpu = _str(data["gpu"], f"{where}: gpu")
    default_gpus = _pos_int(data["gpus_per_node"], f"{where}: gpus_per_node") if "gpus_per_node" in data else None
    fabric = _bool(data.get("fabric_handles", False), f"{where}: fabric_handles")
    multicast = _bool(data.get("multicast", False), f"{where}: multicast")
    rack_name = _str(data.get("name", name), f"{where}: name")
    if "nodes" not in data:
        raise TopologyError(f"{where}: nodes: missing (a count or a list)")
    raw = data["nodes"]
    nodes: list[Node] = []
    if isinstance(raw, int) and not isinstance(raw, bool):
        count = _pos_int(raw, f"{where}: nodes")
        if default_gpus is None:
            raise TopologyError(f"{where}: gpus_per_node: required when nodes is a count")
        nodes = [Node(f"node{i:02d}", default_gpus) for i in range(count)]
    elif isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            at = f"{where}: nodes[{i}]"
            if isinstance(item, str):
                item = {"name": item}
            if not isinstance(item, Mapping):
                raise TopologyError(f"{at}: expected a name or a mapping, got {item!r}")
            bad = sorted(set(item) - _NODE_KEYS)
            if bad:
                raise TopologyError(f"{at}: unknown field(s) {bad}; allowed: {sorted(_NODE_KEYS)}")
            if "name" not in item:
                raise TopologyError(f"{at}.name: missing")
            if "gpus" in item:
                gpus = _pos_int(item["gpus"], f"{at}.gpus")
            elif default_gpus is not None:
                gpus = default_gpus
            else:
                raise TopologyError(f"{at}.gpus: missing and no gpus_per_node default")
            nodes.append(Node(_str(item["name"], f"{at}.name"), gpus, _str(item.get("domain", "nvl0"), f"{at}.domain")))
    else:
        raise TopologyError(f"{where}: nodes: expected a positive count or a non-empty list, got {raw!r}")
    try:
        return Rack(rack_name, gpu, tuple(nodes), fabric, multicast)
    except TopologyError as e:
        raise TopologyError(f"{where}: {e}") from None


def load_rack(spec: str) -> Rack:
    """A built-in rack name, `cpu:N` (one host with N CPU workers), or a YAML file path."""
    if spec in RACKS:
        return RACKS[spec]
    m = re.fullmatch(r"cpu:(\d+)(?:x(\d+))?", spec)
    if m:
        a, b = int(m.group(1)), m.group(2)
        nodes, per = (a, int(b)) if b else (1, a)
        if nodes <= 0 or per <= 0:
            raise TopologyError(f"rack {spec!r}: counts must be positive")
        return _uniform(spec, "cpu", nodes, per, False, False)
    path = pathlib.Path(spec)
    if not path.is_file():
        raise TopologyError(f"rack {spec!r}: not a built-in rack {sorted(RACKS)}, not cpu:N, and no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TopologyError(f"{path}: not valid YAML: {e}") from e
    return rack_from_dict(data, path.stem, str(path))


def rack_from_hostnames(hosts: list[str], gpu: str, domains: list[str] | None = None,
                        fabric_handles: bool = False, multicast: bool = False) -> Rack:
    """One node per host, in rank order; each host's ranks must be contiguous (block mapping)."""
    if not hosts:
        raise TopologyError("no hostnames gathered")
    domains = domains or ["nvl0"] * len(hosts)
    nodes: list[Node] = []
    seen: set[str] = set()
    for rank, (h, d) in enumerate(zip(hosts, domains, strict=True)):
        if nodes and nodes[-1].name == h:
            if nodes[-1].domain != d:
                raise TopologyError(f"rank {rank} on host {h!r} reports NVLink domain {d!r}, its node reported {nodes[-1].domain!r}")
            nodes[-1] = Node(h, nodes[-1].gpus + 1, d)
            continue
        if h in seen:
            raise TopologyError(f"rank {rank} is on host {h!r} again after other hosts: ranks must be "
                                "placed in blocks per node (srun --ntasks-per-node / mpirun -ppn)")
        seen.add(h)
        nodes.append(Node(h, 1, d))
    return Rack("launch", gpu, tuple(nodes), fabric_handles, multicast)


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the launch, as the launcher told it."""

    launcher: str  # "ompi" | "pmi" | "slurm" | "torchrun" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    hostname: str = field(default_factory=socket.gethostname)


def _env_int(env: Mapping[str, str], key: str) -> int:
    raw = env[key]
    try:
        return int(raw)
    except ValueError:
        raise TopologyError(f"{key}={raw!r} is not an integer") from None


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int:
    """Tasks on this node from SLURM_TASKS_PER_NODE ('4(x18)' or '4,3(x2)') and SLURM_NODEID."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _env_int(env, "SLURM_NTASKS_PER_NODE")
    spec = env.get("SLURM_TASKS_PER_NODE")
    if spec is None:
        raise TopologyError("SLURM_PROCID is set but neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE")
    node = _env_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise TopologyError(f"SLURM_TASKS_PER_NODE={spec!r}: cannot parse {part!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node >= len(counts):
        raise TopologyError(f"SLURM_NODEID={node} but SLURM_TASKS_PER_NODE={spec!r} lists {len(counts)} nodes")
    return counts[node]


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank/size/local rank from Open MPI, MPICH/Hydra (PMI_*), Slurm or torchrun variables.

    Open MPI and PMI come first: inside a Slurm allocation, `mpirun` also inherits SLURM_* variables
    that describe the allocation, not the MPI job."""
    env = os.environ if environ is None else environ
    host = env.get("PMI_HOSTNAME") or socket.gethostname()
    if "OMPI_COMM_WORLD_RANK" in env:
        keys = ("ompi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif "PMI_RANK" in env:
        keys = ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    elif "SLURM_PROCID" in env:
        keys = ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)
    elif "RANK" in env and "WORLD_SIZE" in env:
        keys = ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    else:
        return LaunchEnv("single", 0, 1, 0, 1, host)
    launcher, k_rank, k_size, k_local, k_lsize = keys
    for k in (k_rank, k_size):
        if k not in env:
            raise TopologyError(f"{k_rank} is set but {k} is missing")
    rank, size = _env_int(env, k_rank), _env_int(env, k_size)
    local = _env_int(env, k_local) if k_local in env else 0
    if k_lsize is None:
        lsize = _slurm_tasks_on_node(env)
    else:
        lsize = _env_int(env, k_lsize) if k_lsize in env else 1
    if size <= 0:
        raise TopologyError(f"{k_size}={size}: world size must be positive")
    if not 0 <= rank < size:
        raise TopologyError(f"{k_rank}={rank} is outside the world of {k_size}={size}")
    if lsize <= 0 or not 0 <= local < lsize:
        raise TopologyError(f"local rank {local} is outside the local world of {lsize} ({launcher})")
    return LaunchEnv(launcher, rank, size, local, lsize, host)
