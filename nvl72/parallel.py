"""Process groups of a deployment, every one with a timeout, and each rank's TP/EP/DP bookkeeping.

`init_distributed` joins the world (NCCL on GPU, gloo on CPU) at an address taken from
MASTER_ADDR/MASTER_PORT or, under MPI, broadcast by rank 0 through mpi4py; a gloo `control` group
over the world always exists for host-side control (hostnames, plan, front address).
`build_groups` then makes, from the plan, each instance's group (prefill: TP = EP = the node's
ranks; decode: EP over the instance, DP attention ranks, TP groups when decode TP > 1).

torch.distributed requires every rank to create every group in the same order, so all groups are
created on all ranks; a rank keeps the ones it belongs to.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nvl72.plan import Instance, Plan
from nvl72.topology import LaunchEnv

log = logging.getLogger(__name__)

MAX_STRING = 1024  # bytes of one string gathered or broadcast over the control group


class ParallelError(RuntimeError):
    """Process groups that cannot be built (no rendezvous address, plan/world mismatch ...)."""


class CollectiveTimeout(TimeoutError):
    """A collective or point-to-point operation that did not complete within its timeout."""


def wait(work, timeout: float, what: str) -> None:
    """Wait for an async collective with a bound; gloo and NCCL both honour the timeout argument."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise CollectiveTimeout(f"{what} did not complete within {timeout:g} s: {e}") from e
        raise


def free_port(host: str = "") -> int:
    """A TCP port free on `host` now ("" = every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_address() -> str:
    """An address of this host that peers can reach (NVL72_HOST_ADDR overrides)."""
    if os.environ.get("NVL72_HOST_ADDR"):
        return os.environ["NVL72_HOST_ADDR"]
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    if addr.startswith("127."):  # /etc/hosts maps the hostname to loopback: ask the routing table
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks a route
                addr = s.getsockname()[0]
        except OSError:
            pass
    return addr


def rendezvous(env: LaunchEnv, environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """The TCP address of the world's rendezvous: MASTER_ADDR/MASTER_PORT, or chosen by rank 0 and
    broadcast over MPI (mpiexec/mpirun without those variables)."""
    environ = os.environ if environ is None else environ
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        try:
            return environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
        except ValueError:
            raise ParallelError(f"MASTER_PORT={environ['MASTER_PORT']!r} is not a port number") from None
    if env.launcher in ("ompi", "pmi"):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm.Get_size() != env.world_size:
            raise ParallelError(f"MPI world has {comm.Get_size()} ranks but the launcher said {env.world_size}")
        buf = bytearray(256)  # raw bytes through MPI_Bcast (mpi4py's lowercase bcast would pickle)
        if comm.Get_rank() == 0:
            addr = f"{host_address()}:{free_port()}".encode()
            buf[:len(addr)] = addr
        comm.Bcast([buf, MPI.BYTE], root=0)
        host, port = buf.rstrip(b"\0").decode().rsplit(":", 1)
        return host, int(port)
    raise ParallelError(f"launcher {env.launcher!r} with {env.world_size} ranks: set MASTER_ADDR and MASTER_PORT "
                        "(launch/srun.sh does)")


def init_distributed(env: LaunchEnv, device: str, timeout: float) -> dist.ProcessGroup:
    """Join the world; returns the gloo control group (the world itself on CPU)."""
    backend = "nccl" if device == "cuda" else "gloo"
    kw = {}
    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
        kw["device_id"] = torch.device("cuda", env.local_rank)
    if env.world_size == 1:  # nothing to meet: an in-memory store, no port to race for
        kw["store"], where = dist.HashStore(), "an in-process store"
    else:
        addr, port = rendezvous(env)
        kw["init_method"], where = f"tcp://{addr}:{port}", f"{addr}:{port}"
    td = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=td, **kw)
    log.info("rank %d/%d joined the world (%s via %s, timeout %gs)", env.rank, env.world_size, backend, where, timeout)
    return dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=td)


def all_gather_strings(value: str, group: dist.ProcessGroup, timeout: float) -> list[str]:
    """Gather one short string per rank (hostnames, addresses) as raw bytes over a gloo group."""
    data = value.encode()
    if len(data) > MAX_STRING - 2:
        raise ParallelError(f"string of {len(data)} bytes is longer than {MAX_STRING - 2}")
    buf = torch.zeros(MAX_STRING, dtype=torch.uint8)
    buf[:2] = torch.tensor([len(data) // 256, len(data) % 256], dtype=torch.uint8)
    buf[2:2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(out, buf, group=group, async_op=True), timeout, "all_gather of strings")
    return [bytes(t[2:2 + int(t[0]) * 256 + int(t[1])].tolist()).decode() for t in out]


def broadcast_string(value: str | None, src: int, group: dist.ProcessGroup, timeout: float) -> str:
    """Broadcast a short string from global rank `src` (a plan, an address) over a gloo group."""
    n = torch.zeros(1, dtype=torch.int64)
    if dist.get_rank() == src:
        data = bytearray(value.encode())
        n[0] = len(data)
    wait(dist.broadcast(n, src, group=group, async_op=True), timeout, "broadcast of a string length")
    buf = torch.frombuffer(data, dtype=torch.uint8).clone() if dist.get_rank() == src else torch.empty(int(n), dtype=torch.uint8)
    wait(dist.broadcast(buf, src, group=group, async_op=True), timeout, "broadcast of a string")
    return bytes(buf.tolist()).decode()


@dataclass(frozen=True)
class RankRole:
    """Where one rank sits in the plan."""

    rank: int
    role: str  # "prefill" | "decode" | "spare"
    instance: Instance | None
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def name(self) -> str:
        return self.instance.name if self.instance else "spare"


def rank_role(plan: Plan, rank: int) -> RankRole:
    inst = plan.instance_of(rank)
    if inst is None:
        return RankRole(rank, "spare", None)
    i = inst.ranks.index(rank)
    if inst.role == "prefill":  # TP attention, EP experts, over the same ranks
        return RankRole(rank, "prefill", inst, tp_rank=i, tp_size=inst.tp, ep_rank=i, ep_size=inst.ep)
    # decode: ranks [dp0: tp0..tpT-1, dp1: ...]; EP over all of them
    return RankRole(rank, "decode", inst, tp_rank=i % inst.tp, tp_size=inst.tp, dp_rank=i // inst.tp,
                    dp_size=inst.dp, ep_rank=i, ep_size=inst.ep)


@dataclass
class ProcessGroups:
    """This rank's groups (None where the group would hold this rank alone or it has no role)."""

    role: RankRole
    control: dist.ProcessGroup  # gloo over the world
    instance: dist.ProcessGroup | None  # all ranks of my instance (device backend)
    # The world again, for KV transfers only: NCCL runs a group's point-to-point ops in issue order
    # with its collectives, so transfers on the instance's group would stall its MoE collectives.
    transfer: dist.ProcessGroup | None
    tp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def group_lists(plan: Plan) -> dict[str, list[list[int]]]:
    """The rank lists of every group the plan needs, in creation order: instances, and for decode
    instances with TP > 1 their TP groups (consecutive ranks) and DP groups (same TP rank)."""
    decode = [i for i in plan.of_role("decode") if i.tp > 1]
    return {
        "instance": [i.ranks for i in plan.instances],
        "decode_tp": [i.ranks[j:j + i.tp] for i in decode for j in range(0, len(i.ranks), i.tp)],
        "decode_dp": [i.ranks[j::i.tp] for i in decode for j in range(i.tp)],
    }


def _subgroups(lists: list[list[int]], rank: int, timeout: float, backend: str | None) -> dist.ProcessGroup | None:
    if not lists:
        return None
    cur, _ = dist.new_subgroups_by_enumeration(lists, timeout=datetime.timedelta(seconds=timeout), backend=backend)
    return cur if any(rank in lst and len(lst) > 1 for lst in lists) else None


def build_groups(plan: Plan, control: dist.ProcessGroup, timeout: float, backend: str | None = None) -> ProcessGroups:
    """Create every instance/TP/DP group of the plan on every rank; return this rank's."""
    world = dist.get_world_size()
    if world != plan.rack.world_size:
        raise ParallelError(f"the plan is for {plan.rack.world_size} ranks but the world has {world}")
    rank = dist.get_rank()
    role = rank_role(plan, rank)
    lists = group_lists(plan)
    instance = _subgroups(lists["instance"], rank, timeout, backend)
    tp_group = _subgroups(lists["decode_tp"], rank, timeout, backend)
    dp_group = _subgroups(lists["decode_dp"], rank, timeout, backend)
    transfer = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout), backend=backend)
    if role.role == "prefill":
        groups = ProcessGroups(role, control, instance, transfer, tp=instance, ep=instance, dp=None)
    elif role.role == "decode":
        groups = ProcessGroups(role, control, instance, transfer, tp=tp_group, ep=instance,
                               dp=instance if role.tp_size == 1 else dp_group)
    else:
        groups = ProcessGroups(role, control, None, transfer, None, None, None)
    log.info("rank %d: %s tp %d/%d dp %d/%d ep %d/%d", rank, role.name, role.tp_rank, role.tp_size, role.dp_rank,
             role.dp_size, role.ep_rank, role.ep_size)
    return groups
