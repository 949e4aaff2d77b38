"""Worker of test_transport_mp: the last rank is a TP1 decode rank, the others a prefill instance
(`mpiexec -n 3`: TP2 -> TP1 over gloo; `torchrun --nproc-per-node 2 ... --device cuda`: TP1 -> TP1 over
NCCL) through `--transport sendrecv` or `p2p` (rings of 4 slots of 512 bytes, the smallest that hold a
cache row: the KV parts are cut into chunks and the ring wraps); a request's KV pages and GDN states must arrive bit-exactly, and the first
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
SRC_PAGES, DST_PAGES, SRC_SLOT, DST_SLOT = [4, 1, 2, 0, 5], [0, 5, 3, 1, 2], 2, 0
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


def bench(kind: str, tokens: list[int], dev: str, rank: int, src_ranks, dst_ranks, control) -> None:
    """Timed transfers of a Qwen3-30B-A3B-shaped KV cache (8 layers, 4 KV heads of 128, pages of 16,
    bf16; TP1 -> TP1) through `kind` with the serving defaults (layer groups of 4, a 256 MiB ring):
    the receiver is posted before the sender starts, so its measure is the transfer's. One warm-up,
    then three per size; the last one is checked bit-exactly. Prints `BENCH kind tokens bytes ms GB/s`."""
    layout, layers, page = CacheLayout(kv_heads=4), 8, 16
    pages = max(tokens) // page + 8
    gen = torch.Generator().manual_seed(rank)
    caches = {"kv": [torch.randn(pages, 2, 4, page, 128, generator=gen).to(torch.bfloat16).to(dev)
                     for _ in range(layers)], "conv": [None] * layers, "recurrent": [None] * layers}
    tr = open_transport(kind, torch.distributed.group.WORLD, rank, src_ranks, dst_ranks, caches, TIMEOUT, 256 << 20)
    groups = layer_groups(layers, 4)
    seq = 100
    for n in tokens:
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(n))
        src_pages, dst_pages = perm[:n // page].tolist(), perm[-(n // page):].tolist()
        plan = build_transfer_plan(layout, 1, 1, src_pages, dst_pages)
        times = []
        for _ in range(4):  # one warm-up, three timed
            seq += 1
            if rank in dst_ranks:
                r = tr.receiver(seq, plan, 0, src_ranks, dst_ranks, caches, groups, TIMEOUT)
            torch.distributed.barrier(group=control)
            if rank in src_ranks:
                s = tr.sender(seq, plan, 0, src_ranks, dst_ranks, caches, groups)
                s.send_all()
                s.send_first_token(seq)
                s.wait(TIMEOUT)
            else:
                r.wait()
                nbytes, secs = r.measured()
                times.append(secs)
            torch.distributed.barrier(group=control)
        if rank in src_ranks:
            torch.distributed.send(torch.stack([c[src_pages].cpu() for c in caches["kv"]]), dst_ranks[0], group=control)
        else:
            want = torch.empty((layers, n // page) + tuple(caches["kv"][0].shape[1:]), dtype=torch.bfloat16)
            torch.distributed.recv(want, src_ranks[0], group=control)
            got = torch.stack([c[dst_pages].cpu() for c in caches["kv"]])
            assert torch.equal(got, want), f"{kind}: {n}-token transfer differs"
            ms = sorted(times[1:])[1] * 1e3
            total = sum(nbytes.values())
            print(f"BENCH {kind} {n} {total} {ms:.3f} {total / ms / 1e6:.1f}", flush=True)
    tr.close()


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
    if env.rank < src_tp:
        caches = sharded(full, src_tp, env.rank, dev)
    else:
        gen = torch.Generator().manual_seed(99)
        caches = {k: [None if t is None else torch.randn(t.shape, generator=gen).to(t.dtype).to(dev) for t in ts]
                  for k, ts in sharded(full, 1, 0).items()}
    tr = open_transport(transport, torch.distributed.group.WORLD, env.rank, src_ranks, dst_ranks, caches, TIMEOUT,
                        4 * 512)
    assert tr.name == transport, (tr.name, transport)
    if env.rank < src_tp:
        s = tr.sender(11, plan, env.rank, src_ranks, dst_ranks, caches, groups)
        s.send_group(0)
        if device == "cuda":  # the second layer group is "still computing"
            time.sleep(1.0)
        else:  # ... until the decode rank has polled once (a gloo message beside the transfer)
            torch.distributed.recv(torch.zeros(1), src=src_tp, group=control, tag=999)
        s.send_group(1)
        s.send_first_token(4242)
        s.wait(TIMEOUT)
    else:
        mine = caches
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
    if "--bench" in sys.argv:
        bench(transport, [int(x) for x in sys.argv[sys.argv.index("--bench") + 1].split(",")], dev, env.rank,
              src_ranks, dst_ranks, control)
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
