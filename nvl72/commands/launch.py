"""`nvl72 launch`: start this rank's role under srun/mpirun (one process per GPU).

Every rank: read its place from the launcher's environment, join the world (NCCL on GPU, gloo on
CPU, with a gloo control group), gather hostnames, take the plan (`--plan` file, or computed from
the same arguments as `nvl72 plan` on every rank), build its process groups, and run its role.
The rank that the plan names for the front also runs the front's control plane in a thread: it
collects each rank's readiness, heartbeats and goodbyes over ZeroMQ (ROUTER <- DEALER per rank,
msgpack messages with a version field) and tells every rank to shut down on an operator's
`shutdown` message, a signal, `--run-seconds`, or a rank that stops heartbeating.

With `--engine-args` (build_engine keywords as JSON; `{}` is the embedded default model) the ranks
serve disaggregated (`nvl72.disagg.serving`): prefill ranks prefill and ship KV to decode ranks,
decode ranks decode, and the front rank also runs the OpenAI HTTP front (`--http-port`) over them.
Decode ranks are expendable: one that stops heartbeating fails only its own requests. Without
`--engine-args` every role is `idle_role`: report ready (with a check that its groups carry an
all-reduce), heartbeat, exit cleanly when told.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, ClassVar

import msgpack

from nvl72.cli import CLIError
from nvl72.commands.plan import add_plan_arguments, plan_from_args
from nvl72.engine import protocol
from nvl72.engine.protocol import LoadReport, ProtocolError, Shutdown

if TYPE_CHECKING:  # the runtime imports stay inside run(): `nvl72 --help` must not import torch
    from nvl72.parallel import ProcessGroups
    from nvl72.plan import Plan

HELP = "start this rank's role under srun/mpirun (one process per GPU)"
log = logging.getLogger("nvl72.launch")


# ---------------------------------------------------------------------------------------------
# Control messages (front <-> ranks). Heartbeats are the engine protocol's LoadReport, the stop
# order its Shutdown; readiness, goodbye and heartbeat acknowledgements are the launcher's own.
# ---------------------------------------------------------------------------------------------
@dataclass
class RankReady:
    KIND: ClassVar[str] = "rank_ready"
    rank: int
    role: str
    instance: str
    host: str
    pid: int
    device: str
    tp: list[int]  # [rank, size]
    dp: list[int]
    ep: list[int]
    group_sums: dict[str, int] = field(default_factory=dict)  # all-reduce of ones over each group


@dataclass
class RankBye:
    KIND: ClassVar[str] = "rank_bye"
    rank: int


@dataclass
class HeartbeatAck:
    KIND: ClassVar[str] = "heartbeat_ack"
    time: float


_CONTROL = {c.KIND: c for c in (RankReady, RankBye, HeartbeatAck)}


def encode(msg) -> bytes:
    if msg.KIND in _CONTROL:
        return msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": msg.KIND, "body": asdict(msg)}, use_bin_type=True)
    return protocol.encode(msg)


def decode(data: bytes):
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable control message: {e}") from e
    if isinstance(raw, dict) and raw.get("kind") in _CONTROL:
        if raw.get("v") != protocol.PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported protocol version {raw.get('v')!r}")
        try:
            return _CONTROL[raw["kind"]](**raw["body"])
        except TypeError as e:
            raise ProtocolError(f"bad fields for {raw['kind']!r}: {e}") from e
    return protocol.decode(data)


def request_shutdown(address: str, reason: str = "operator", timeout: float = 5.0) -> None:
    """Ask a running launch's front to shut every rank down (what an operator or a test calls)."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, int(timeout * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    try:
        sock.connect(address)
        sock.send(encode(Shutdown(reason)))
    finally:
        sock.close()


# ---------------------------------------------------------------------------------------------
# Front control plane
# ---------------------------------------------------------------------------------------------
class Front(threading.Thread):
    """Collects readiness and heartbeats of all ranks; broadcasts shutdown; exit_code 0 when every
    rank came up, stayed alive and said goodbye in time."""

    def __init__(self, world_size: int, host: str, port: int, heartbeat_timeout: float, ready_timeout: float,
                 shutdown_timeout: float, run_seconds: float | None, ready_file: str | None):
        super().__init__(name="nvl72-front", daemon=True)
        import zmq

        self.world_size, self.hb_timeout, self.ready_timeout = world_size, heartbeat_timeout, ready_timeout
        self.shutdown_timeout, self.run_seconds, self.ready_file = shutdown_timeout, run_seconds, ready_file
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port == 0:
            port = self.sock.bind_to_random_port("tcp://*")
        else:
            self.sock.bind(f"tcp://*:{port}")
        self.address = f"tcp://{host}:{port}"
        self.ready: dict[int, RankReady] = {}
        self.identity: dict[int, bytes] = {}
        self.last_seen: dict[int, float] = {}
        self.bye: set[int] = set()
        self.expendable: set[int] = set()  # ranks whose loss is tolerated (serving decode ranks)
        self.lost: set[int] = set()
        self.exit_code = 0
        self._stop_reason: str | None = None
        self._lock = threading.Lock()

    def stop(self, reason: str, failed: bool = False) -> None:
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = reason
                log.info("front: shutting down all ranks (%s)", reason)
            if failed:
                self.exit_code = 1

    def _all_ready(self) -> None:
        ranks = [asdict(self.ready[r]) for r in sorted(self.ready)]
        log.info("front: all %d ranks ready at %s: %s", self.world_size, self.address,
                 ", ".join(f"{r['rank']}={r['instance']}" for r in ranks))
        if self.ready_file:
            tmp = pathlib.Path(self.ready_file + ".tmp")
            tmp.write_text(json.dumps({"front": self.address, "world_size": self.world_size, "ranks": ranks}))
            tmp.replace(self.ready_file)

    def _handle(self, ident: bytes, data: bytes, now: float) -> None:
        try:
            msg = decode(data)
        except ProtocolError as e:
            log.warning("front: dropped a bad message: %s", e)
            return
        rank = getattr(msg, "rank", 0)
        if not 0 <= rank < self.world_size:
            log.warning("front: dropped %s from rank %d of a world of %d", msg.KIND, rank, self.world_size)
            return
        if isinstance(msg, RankReady):
            self.ready[msg.rank], self.identity[msg.rank], self.last_seen[msg.rank] = msg, ident, now
            log.info("front: rank %d ready (%s on %s, pid %d)", msg.rank, msg.instance, msg.host, msg.pid)
        elif isinstance(msg, LoadReport):
            self.last_seen[msg.rank] = now
            self.sock.send_multipart([ident, encode(HeartbeatAck(now))])
        elif isinstance(msg, RankBye):
            self.bye.add(msg.rank)
            if self._stop_reason is None:
                self.stop(f"rank {msg.rank} left", failed=True)
        elif isinstance(msg, Shutdown):
            self.stop(msg.reason)

    def run(self) -> None:
        import zmq

        start = time.monotonic()
        all_ready_at = None
        shutdown_started = last_sent = None
        while True:
            if self.sock.poll(100, zmq.POLLIN):
                while True:  # drain, then check: a steady stream of heartbeats must not starve the checks
                    try:
                        ident, data = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(ident, data, time.monotonic())
            now = time.monotonic()
            if all_ready_at is None and len(self.ready) == self.world_size:
                all_ready_at = now
                self._all_ready()
            if all_ready_at is None and now - start > self.ready_timeout:
                missing = sorted(set(range(self.world_size)) - set(self.ready))
                self.stop(f"ranks {missing} not ready within {self.ready_timeout:g} s", failed=True)
            late = [r for r, t in self.last_seen.items()
                    if r not in self.bye and r not in self.lost and now - t > self.hb_timeout]
            for r in [r for r in late if r in self.expendable]:
                log.error("front: rank %d missed heartbeats for %g s; serving on without it", r, self.hb_timeout)
                self.lost.add(r)
                late.remove(r)
            if late and self._stop_reason is None:
                self.stop(f"ranks {late} missed heartbeats for {self.hb_timeout:g} s", failed=True)
            if all_ready_at is not None and self.run_seconds is not None and now - all_ready_at >= self.run_seconds:
                self.stop(f"--run-seconds {self.run_seconds:g} elapsed")
            if self._stop_reason is None:
                continue
            shutdown_started = shutdown_started or now
            if self.bye | self.lost >= set(self.identity):  # every rank that came up has left (or was lost)
                break
            if now - shutdown_started > self.shutdown_timeout:
                log.error("front: ranks %s did not say goodbye within %g s", sorted(set(self.identity) - self.bye),
                          self.shutdown_timeout)
                self.exit_code = 1
                break
            if last_sent is None or now - last_sent > 0.5:  # resend until every rank said goodbye
                for r, ident in self.identity.items():
                    if r not in self.bye and r not in self.lost:
                        self.sock.send_multipart([ident, encode(Shutdown(self._stop_reason))])
                last_sent = now
        self.sock.close()
        log.info("front: done (exit code %d)", self.exit_code)


# ---------------------------------------------------------------------------------------------
# Rank side
# ---------------------------------------------------------------------------------------------
class RankAgent:
    """A rank's line to the front: readiness, heartbeats, and whether to stop."""

    def __init__(self, rank: int, address: str, heartbeat: float, heartbeat_timeout: float):
        import zmq

        self.rank, self.heartbeat_s, self.hb_timeout = rank, heartbeat, heartbeat_timeout
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(address)
        self.stop_reason: str | None = None
        self._last_beat = 0.0
        self._last_ack = time.monotonic()

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def beat(self, stats: dict[str, float] | None = None, poll_s: float | None = None) -> None:
        """Send a heartbeat when one is due, read the front's messages for up to `poll_s` seconds
        (default one heartbeat; a serving loop passes 0)."""
        import zmq

        now = time.monotonic()
        if now - self._last_beat >= self.heartbeat_s:
            self.send(LoadReport(self.rank, 0, 0, 0.0, time.time(), stats or {}))
            self._last_beat = now
        if self.sock.poll(int((self.heartbeat_s if poll_s is None else poll_s) * 1000), zmq.POLLIN):
            msg = decode(self.sock.recv())
            if isinstance(msg, Shutdown):
                self.stop_reason = msg.reason
            elif isinstance(msg, HeartbeatAck):
                self._last_ack = time.monotonic()
        if self.stop_reason is None and time.monotonic() - self._last_ack > self.hb_timeout:
            self.stop_reason = f"front silent for {self.hb_timeout:g} s"

    def close(self) -> None:
        self.send(RankBye(self.rank))
        self.sock.close()


@dataclass
class RoleContext:
    """What a role body gets: the plan, its groups, its line to the front, and the stop event
    (set by SIGTERM/SIGINT); it returns the rank's exit code."""

    plan: Plan
    groups: ProcessGroups
    agent: RankAgent
    device: str
    timeout: float
    stop: threading.Event
    args: argparse.Namespace | None = None
    data_address: str = ""  # the front's data-plane socket (serving)


def _group_sums(ctx: RoleContext) -> dict[str, int]:
    """All-reduce ones over each of this rank's groups: proves the groups carry a collective."""
    import torch
    import torch.distributed as dist

    from nvl72.parallel import wait

    out = {}
    for name in ("instance", "tp", "ep", "dp"):
        g = getattr(ctx.groups, name)
        if g is None:
            continue
        t = torch.ones(1, device="cuda" if ctx.device == "cuda" else "cpu")
        wait(dist.all_reduce(t, group=g, async_op=True), ctx.timeout, f"{name} group check")
        out[name] = int(t.item())
    return out


def report_ready(ctx: RoleContext) -> None:
    r = ctx.groups.role
    host = os.environ.get("PMI_HOSTNAME") or os.uname().nodename
    ctx.agent.send(RankReady(r.rank, r.role, r.name, host, os.getpid(), ctx.device, [r.tp_rank, r.tp_size],
                             [r.dp_rank, r.dp_size], [r.ep_rank, r.ep_size], _group_sums(ctx)))


def idle_role(ctx: RoleContext) -> int:
    """Join, report ready, heartbeat, stop when told (control plane only, or a spare rank)."""
    report_ready(ctx)
    while ctx.agent.stop_reason is None and not ctx.stop.is_set():
        ctx.agent.beat()
    return 0


def _serving_options(ctx: RoleContext):
    from nvl72.disagg.serving import ServingOptions

    from nvl72.commands.serve import parse_bytes

    a = ctx.args
    return ServingOptions(json.loads(a.engine_args), a.transfer_timeout, kv_transport=a.kv_transport,
                          kv_ring_bytes=parse_bytes("kv-transport-ring", a.kv_transport_ring))


def prefill_role(ctx: RoleContext) -> int:
    from nvl72.disagg.serving import prefill_role as body

    return body(ctx, _serving_options(ctx), lambda: report_ready(ctx))


def decode_role(ctx: RoleContext) -> int:
    from nvl72.disagg.serving import decode_role as body

    return body(ctx, _serving_options(ctx), lambda: report_ready(ctx))


ROLES: dict[str, Callable[[RoleContext], int]] = {"prefill": idle_role, "decode": idle_role, "spare": idle_role}
SERVING_ROLES: dict[str, Callable[[RoleContext], int]] = {"prefill": prefill_role, "decode": decode_role,
                                                          "spare": idle_role}


class HTTPFront(threading.Thread):
    """The front rank's HTTP server over a `DisaggClient`: starts once every engine rank reported."""

    def __init__(self, plan: Plan, hub, args: argparse.Namespace):
        super().__init__(name="nvl72-http-front", daemon=True)
        from nvl72.disagg.serving import DisaggClient

        # Prefill instances take requests on their leader; decode instances on each DP rank (TP rank 0).
        ranks = {"prefill": [i.ranks[0] for i in plan.of_role("prefill")],
                 "decode": [r for i in plan.of_role("decode") for r in i.ranks[::i.tp]]}
        self.client = DisaggClient(hub, ranks["prefill"], ranks["decode"], batch_threshold=args.decode_batch_threshold,
                                   lost_timeout=args.rank_lost_timeout)
        self.args, self.server = args, None

    def run(self) -> None:
        from nvl72.commands.serve import load_tokenizer
        from nvl72.server.app import ServerConfig, build_app
        from nvl72.server.runner import ServerThread

        a = self.args
        try:
            self.client.wait_ready(a.ready_timeout)
            model = json.loads(a.engine_args).get("model")
            app = build_app(self.client, load_tokenizer(model), ServerConfig(served_model_name=a.served_model_name))
            self.server = ServerThread(app, host=a.http_host, port=a.http_port, log_level="warning").start()
        except Exception:
            log.exception("front: the HTTP front did not start")
            return
        log.info("front: HTTP on %s (model %s)", self.server.url, a.served_model_name)

    def stop(self) -> None:
        """Fail what is in flight (503), then stop the HTTP server."""
        import asyncio

        asyncio.run(self.client.shutdown())
        self.join(10)
        if self.server is not None:
            self.server.stop()


# ---------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser, rack_default=None)
    parser.add_argument("--plan", help="a plan written by `nvl72 plan --out` (instead of the plan arguments)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: one GPU per rank (NCCL); cpu: CPU workers (gloo); auto: cuda when present")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for every collective (default 300)")
    parser.add_argument("--front-port", type=int, default=0, help="port of the front's control socket (0: any)")
    parser.add_argument("--front-host", help="address ranks use to reach the front (default: this host's)")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats (default 1)")
    # Serving ranks heartbeat between engine steps, and a rank's first forwards JIT-compile kernels
    # for seconds (the H200 run's first 1K prefill outlasted a 5 s limit): the defaults allow that.
    parser.add_argument("--heartbeat-timeout", type=float, default=60.0,
                        help="a rank (or the front) silent this long is lost: shut down (default 60)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for all ranks to be ready")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds for all ranks to leave")
    parser.add_argument("--run-seconds", type=float, help="shut down this long after all ranks are ready")
    parser.add_argument("--ready-file", help="the front writes the ranks' readiness here as JSON")
    parser.add_argument("--engine-args", help="serve: build_engine keywords as JSON on every prefill/decode rank "
                                              "('{}': the embedded default model); without it roles idle")
    parser.add_argument("--http-host", default="0.0.0.0", help="serve: HTTP address of the front")
    parser.add_argument("--http-port", type=int, default=8000, help="serve: HTTP port of the front (0: any)")
    parser.add_argument("--served-model-name", default="nvl72", help="serve: the model name clients use")
    parser.add_argument("--transfer-timeout", type=float, default=60.0, help="serve: seconds for one KV transfer")
    # sendrecv by default: it is the path measured on H200s; the p2p rings are tested on CPU only so far
    parser.add_argument("--kv-transport", choices=("auto", "p2p", "sendrecv"), default="sendrecv",
                        help="serve: KV transfers through torch.distributed send/recv (default) or staging rings in "
                             "peer memory (p2p: NVLink on GPU, shared memory on CPU; not yet run on a GPU); auto: "
                             "p2p on CUDA when every rank maps its peers, else sendrecv")
    parser.add_argument("--kv-transport-ring", default="256MiB",
                        help="serve, p2p: staging ring per (prefill rank, decode rank) link, 4 slots; every prefill "
                             "and decode rank holds one per prefill rank (default 256MiB)")
    parser.add_argument("--rank-lost-timeout", type=float, default=60.0,
                        help="serve: a rank without a load report this long is dead (default 60)")


def _fabric_cluster(index: int) -> str | None:
    """The NVLink fabric clique this GPU belongs to (GB200: NVML's fabric cluster UUID), if any."""
    try:
        import pynvml
    except ImportError:
        return None
    import ctypes

    try:
        pynvml.nvmlInit()
        info = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(pynvml.nvmlDeviceGetHandleByIndex(index), ctypes.byref(info))
    except (pynvml.NVMLError, AttributeError) as e:  # no fabric (HGX, PCIe) or an older NVML
        log.info("GPU %d: no NVLink fabric cluster from NVML (%s)", index, e)
        return None
    if info.state != getattr(pynvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3) or info.status != 0:
        return None
    # The UUID is raw bytes (NULs included), which ctypes' char-array access would cut short.
    raw = ctypes.string_at(ctypes.addressof(info) + type(info).clusterUuid.offset, 16)
    return f"fabric-{raw.hex()}-{info.cliqueId}"  # cluster + clique: one NVLink partition


def local_fabric(device: str, local_rank: int, hostname: str) -> tuple[str, bool, bool]:
    """(NVLink domain, fabric handles, multicast) of this rank's GPU. The domain is
    NVL72_NVLINK_DOMAIN if set, else the fabric cluster (NVL72), else the host (an HGX node is its
    own NVLink domain). Driver queries only: nothing is created."""
    domain = os.environ.get("NVL72_NVLINK_DOMAIN")
    if device != "cuda":
        return domain or hostname, False, False
    from comms.heap import device_capabilities

    caps = device_capabilities(local_rank)
    return domain or _fabric_cluster(local_rank) or hostname, caps["fabric"], caps["multicast"]


def _gpu_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name()
    for known in ("GB200", "B200", "H200", "H100"):
        if known in name:
            return known
    return name


def run(args: argparse.Namespace) -> int:
    import torch

    from nvl72.parallel import (ParallelError, all_gather_strings, broadcast_string, build_groups, host_address,
                                init_distributed)
    from nvl72.plan import Plan, PlanError
    from nvl72.topology import TopologyError, launch_env, rack_from_hostnames

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        env = launch_env()
        control = init_distributed(env, device, args.timeout)
        domain, fabric, multicast = local_fabric(device, env.local_rank, env.hostname)
        mine = "\t".join([env.hostname, domain, str(int(fabric)), str(int(multicast))])
        gathered = [s.split("\t") for s in all_gather_strings(mine, control, args.timeout)]
        if args.plan:
            plan = Plan.from_json(pathlib.Path(args.plan).read_text(), args.plan)
        else:
            rack = None if args.rack else rack_from_hostnames(
                [g[0] for g in gathered], _gpu_name(device), [g[1] for g in gathered],
                fabric_handles=all(g[2] == "1" for g in gathered), multicast=all(g[3] == "1" for g in gathered))
            plan = plan_from_args(args, rack)
        if plan.rack.world_size != env.world_size:
            raise CLIError(f"the plan's rack {plan.rack.name} has {plan.rack.world_size} ranks but the launcher "
                           f"started {env.world_size}")
        groups = build_groups(plan, control, args.timeout)
    except (TopologyError, PlanError, ParallelError, OSError) as e:
        raise CLIError(str(e)) from None

    serving = args.engine_args is not None
    if serving:
        try:
            if not isinstance(json.loads(args.engine_args), dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise CLIError(f"--engine-args {args.engine_args!r}: {e}") from None
    stop = threading.Event()
    front = hub = http = None
    if env.rank == plan.front_rank:
        log.info("plan for %s:\n%s", plan.model, "\n".join([plan.rack.describe(), *plan.layout()]))
        front = Front(env.world_size, args.front_host or host_address(), args.front_port, args.heartbeat_timeout,
                      args.ready_timeout, args.shutdown_timeout, args.run_seconds, args.ready_file)
        if serving:
            from nvl72.disagg.serving import FrontHub

            front.expendable = {r for i in plan.of_role("decode") for r in i.ranks}
            hub = FrontHub(args.front_host or host_address())
            http = HTTPFront(plan, hub, args)
            http.start()
        front.start()
        log.info("front control plane on %s", front.address)

    def on_signal(signum, _frame):
        stop.set()
        if front is not None:
            front.stop(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    address = broadcast_string(front.address if front else None, plan.front_rank, control, args.timeout)
    agent = RankAgent(env.rank, address, args.heartbeat, args.heartbeat_timeout)
    data = broadcast_string(hub.address if hub else "", plan.front_rank, control, args.timeout) if serving else ""
    ctx = RoleContext(plan, groups, agent, device, args.timeout, stop, args, data)
    code = (SERVING_ROLES if serving else ROLES)[groups.role.role](ctx)
    if http is not None:
        http.stop()
    log.info("rank %d: %s leaving (%s)", env.rank, groups.role.name, agent.stop_reason or "signal")
    agent.close()
    if front is not None:
        front.join(args.shutdown_timeout + 5)
        code = code or front.exit_code or int(front.is_alive())
    import torch.distributed as dist

    from nvl72.parallel import CollectiveTimeout, wait

    try:
        wait(dist.barrier(group=control, async_op=True), args.timeout, "shutdown barrier")
    except CollectiveTimeout as e:
        log.error("rank %d: %s", env.rank, e)
        code = code or 1
    groups.destroy()
    return code
