"""The front's control plane in one process: readiness of every rank, heartbeat loss, bad messages,
and shutdown resent until each rank says goodbye."""
import json
import time

import zmq

from nvl72.commands.launch import Front, RankAgent, RankBye, RankReady, decode, encode
from nvl72.engine.protocol import Shutdown


def _ready(rank):
    return RankReady(rank, "decode", "decode[0]", "h", 100 + rank, "cpu", [0, 1], [rank, 2], [rank, 2])


def _front(tmp_path, **kw):
    args = dict(world_size=2, host="127.0.0.1", port=0, heartbeat_timeout=5.0, ready_timeout=20.0,
                shutdown_timeout=10.0, run_seconds=None, ready_file=str(tmp_path / "ready.json"))
    args.update(kw)
    f = Front(**args)
    f.start()
    return f


def test_ready_then_operator_shutdown(tmp_path):
    front = _front(tmp_path)
    agents = [RankAgent(r, front.address, heartbeat=0.05, heartbeat_timeout=5.0) for r in range(2)]
    try:
        for a in agents:
            a.send(_ready(a.rank))
        # A malformed message is dropped, not fatal.
        junk = zmq.Context.instance().socket(zmq.DEALER)
        junk.connect(front.address)
        junk.send(b"\xc1 not msgpack")
        deadline = time.monotonic() + 10
        while not (tmp_path / "ready.json").exists() and time.monotonic() < deadline:
            for a in agents:
                a.beat()
        info = json.loads((tmp_path / "ready.json").read_text())
        assert [r["rank"] for r in info["ranks"]] == [0, 1] and info["front"] == front.address
        junk.send(encode(Shutdown("operator")))
        junk.close(linger=1000)
        while any(a.stop_reason is None for a in agents) and time.monotonic() < deadline:
            for a in agents:
                a.beat()
        assert [a.stop_reason for a in agents] == ["operator", "operator"]
    finally:
        for a in agents:
            a.close()
    front.join(10)
    assert not front.is_alive() and front.exit_code == 0


def test_a_silent_rank_shuts_everyone_down(tmp_path):
    front = _front(tmp_path, heartbeat_timeout=0.5)
    alive = RankAgent(0, front.address, heartbeat=0.05, heartbeat_timeout=5.0)
    silent = zmq.Context.instance().socket(zmq.DEALER)
    silent.setsockopt(zmq.IDENTITY, b"rank1")
    silent.connect(front.address)
    try:
        alive.send(_ready(0))
        silent.send(encode(_ready(1)))
        t0 = time.monotonic()
        while alive.stop_reason is None and time.monotonic() - t0 < 10:
            alive.beat()
        assert "ranks [1] missed heartbeats" in alive.stop_reason
        assert silent.poll(5000) and isinstance(decode(silent.recv()), Shutdown)
        silent.send(encode(RankBye(1)))
    finally:
        alive.close()
        silent.close(linger=1000)
    front.join(10)
    assert not front.is_alive() and front.exit_code == 1


def test_ranks_that_never_come_up_fail_the_launch(tmp_path):
    front = _front(tmp_path, ready_timeout=0.5, shutdown_timeout=1.0)
    front.join(10)
    assert not front.is_alive() and front.exit_code == 1
    assert not (tmp_path / "ready.json").exists()


def test_a_silent_front_stops_the_rank():
    ctx = zmq.Context.instance()
    sink = ctx.socket(zmq.ROUTER)  # accepts heartbeats, never acknowledges
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    agent = RankAgent(0, f"tcp://127.0.0.1:{port}", heartbeat=0.05, heartbeat_timeout=0.3)
    t0 = time.monotonic()
    while agent.stop_reason is None and time.monotonic() - t0 < 5:
        agent.beat()
    assert agent.stop_reason == "front silent for 0.3 s"
    agent.close()
    sink.close(linger=0)
