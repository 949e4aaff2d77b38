"""Worker of test_transport_mp: the last rank is a TP1 decode rank, the others a prefill instance
(`mpiexec -n 3`: TP2 -> TP1 over gloo; `torchrun --nproc-per-node 2 ... --device cuda`: TP1 -> TP1 over
NCCL) through `--transport sendrecv` or `p2p` (rings of 4 slots of 256 bytes on CPU, 512 on GPU, the
smallest that hold a row: parts are cut into chunks and the ring wraps); a request's KV pages and GDN states must arrive bit-exactly, and the first
token last."""
import sys
import time

import torch

from nvl72.disagg.plan import CacheLayout, build_transfer_plan, shard
from nvl72.disagg.transport import TransferTimeout, caches_of, layer_groups, open_transport
from nvl72.model.batch import ModelCaches
from nvl72.parallel import init_distributed
from nvl72.topology import launch_env

LAYOUT = CacheLayout(kv_heads=2, gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=6, gdn_v_dim=5)
LAYERS, PAGES, SLOTS = 4, 6, 3  # layers 0 and 3: attention; 1, 2: GDN
SRC_PAGES, DST_PAGES, SRC_SLOT, DST_SLOT = [4, 1, 2], [0, 5, 3], 2, 0
TIMEOUT = 30.0


def full_caches(gen):
    kv = [torch.randn(PAGES, 2, 2, 4, 8, generator=gen).to(torch.bfloat16) if l in (0, 3) else None for l in range(LAYERS)]
    conv_dim = 2 * 2 * 6 + 4 * 5
    conv = [torch.randn(SLOTS, conv_dim, 3, generator=gen).to(torch.bfloat16) if l in (1, 2) else None for l in range(LAYERS)]
    rec = [torch.randn(SLOTS, 4, 6, 5, generator=gen) if l in (1, 2) else None for l in range(LAYERS)]
    return {"kv": kv, "conv": conv, "recurrent": rec}


def sharded(full, tp, rank, device="cpu"):
    """The caches a TP rank holds, as the engine keeps them (ModelCaches), seen by the transport."""
    part = {k: [None if t is None else shard(t, k, LAYOUT, tp, rank).to(device) for t in ts] for k, ts in full.items()}
    return caches_of(ModelCaches(kv=part["kv"], conv=part["conv"], recurrent=part["recurrent"]))


def main():
    env = launch_env()
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    transport = sys.argv[sys.argv.index("--transport") + 1] if "--transport" in sys.argv else "sendrecv"
    control = init_distributed(env, device, TIMEOUT)  # gloo: the "go" signal below (CPU)
    dev = f"cuda:{env.local_rank}" if device == "cuda" else "cpu"
    src_tp = env.world_size - 1
    full = full_caches(torch.Generator().manual_seed(7))  # the same on every rank: the reference
    plan = build_transfer_plan(LAYOUT, src_tp, 1, SRC_PAGES, DST_PAGES, SRC_SLOT, DST_SLOT)
    groups = layer_groups(LAYERS, 2)
    src_ranks, dst_ranks = list(range(src_tp)), [src_tp]
    tr = open_transport(transport, torch.distributed.group.WORLD, env.rank, src_ranks, dst_ranks, torch.device(dev), TIMEOUT,
                        4 * (512 if device == "cuda" else 256))
    assert tr.name == transport, (tr.name, transport)
    if env.rank < src_tp:
        s = tr.sender(11, plan, env.rank, src_ranks, dst_ranks, sharded(full, src_tp, env.rank, dev), groups)
        s.send_group(0)
        if device == "cuda":  # the second layer group is "still computing"
            time.sleep(1.0)
        else:  # ... until the decode rank has polled once (a gloo message beside the transfer)
            torch.distributed.recv(torch.zeros(1), src=src_tp, group=control, tag=999)
        s.send_group(1)
        s.send_first_token(4242)
        s.wait(TIMEOUT)
    else:
        gen = torch.Generator().manual_seed(99)
        mine = {k: [None if t is None else torch.randn(t.shape, generator=gen).to(t.dtype).to(dev) for t in ts]
                for k, ts in sharded(full, 1, 0).items()}
        r = tr.receiver(11, plan, 0, src_ranks, dst_ranks, mine, groups, TIMEOUT)
        if device != "cuda":
            assert not r.poll(), "complete before the last layer group and the first token were sent"
            for src in src_ranks:
                torch.distributed.send(torch.ones(1), dst=src, group=control, tag=999)
        while not r.poll():  # raises TransferTimeout past TIMEOUT
            time.sleep(0.01)
        assert r.receipt.require_complete() == 4242
        want = sharded(full, 1, 0, dev)
        for l in (0, 3):
            for sp, dp in zip(SRC_PAGES, DST_PAGES):
                assert torch.equal(mine["kv"][l][dp], want["kv"][l][sp]), (l, sp, dp)
        for kind in ("conv", "recurrent"):
            for l in (1, 2):
                assert torch.equal(mine[kind][l][DST_SLOT], want[kind][l][SRC_SLOT]), (kind, l)
        print(f"TRANSFER_OK TP{src_tp}->TP1 on {dev} over {transport}", flush=True)
    if transport == "p2p":  # a request nobody receives fails its sender within the bound
        torch.distributed.barrier(group=control)
        if env.rank < src_tp:
            s = tr.sender(13, plan, env.rank, src_ranks, dst_ranks, sharded(full, src_tp, env.rank, dev), groups)
            s.send_all()
            s.send_first_token(1)
            t0 = time.monotonic()
            try:
                s.wait(1.0)
                raise SystemExit("a send nobody received completed")
            except TransferTimeout as e:
                print(f"SENDER_TIMEOUT_OK {time.monotonic() - t0:.1f}s {str(e)[:80]}", flush=True)
        torch.distributed.barrier(group=control)
    if device == "cuda":  # a timed-out NCCL receive aborts the communicator: the bound is gloo's test
        tr.close()
        torch.distributed.destroy_process_group()
        return 0
    # A request nobody sends must time out within its bound (this closes the gloo pairs, so it comes last
    # and the ranks meet again over MPI).
    from mpi4py import MPI

    if env.rank == 2:
        t0 = time.monotonic()
        r = tr.receiver(12, plan, 0, src_ranks, dst_ranks, sharded(full, 1, 0), groups, timeout=1.0)
        try:
            r.wait()
            raise SystemExit("a request nobody sent completed")
        except TransferTimeout as e:
            print(f"TIMEOUT_OK {time.monotonic() - t0:.1f}s {str(e)[:80]}", flush=True)
    MPI.COMM_WORLD.Barrier()
    tr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
