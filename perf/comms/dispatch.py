"""MoE dispatch/combine: fused DP-EP kernels vs an NCCL all_to_all path and the send/recv floor.

One process per GPU (spawned here). Per (hidden, experts) one fused `DispatchCombine` on a
`SymmetricHeap` sized for the largest token count; per tokens-per-rank T, on uniformly random
top-k routing:
  fused   CUDA-graph replay of `iters` dispatches and of `iters` dispatch+combine pairs (per-op
          time = replay time / iters; max over ranks); combine = pair - dispatch (combine's protocol
          needs a dispatch between two calls: its partials are polled in place, see
          comms.kernels.dispatch);
  nccl    the torch.distributed reference on NCCL (count exchange, all_to_all_single of rows and
          metadata, per-expert permutation; combine: local weighted sum, all_to_all back, sum), eager
          (it needs the counts on the host), wall clock per call, median;
  a2a     all_to_all_single of exactly the rows that cross ranks (no permutation, no metadata),
          `iters` eager calls back to back timed with events (launch overhead included);
  floor   bytes leaving this GPU / NCCL send-recv bandwidth measured in the same run.
`--payload bf16,mxfp8` runs each row per dispatch payload (mxfp8: tokens quantized in the dispatch
kernel, H + H/32 bytes per row on the wire; combine stays bf16; the NCCL columns move bf16 rows);
`--pipeline 1,4` runs each row per `pipeline_phases` (4: the pipelined dispatch, which sends in 4
phases from PIPE_MIN_TOKENS tokens on and packs each phase while the next is on the wire), and per
`--send-warps` value (warps per block sending while the others pack); payload column
"<payload>/p4w2";
`--overlap auto,0,1` runs each row per overlap setting (1: the tables go first and own rows are
packed while the sends are on the wire -- pipelined: each send phase packs its own rows while the
previous phase's peer rows are packed; auto: from OVERLAP_MIN_TOKENS tokens); payload column
"<payload>/ov0" or "/ov1" when forced;
`--pdl auto,none,dispatch,combine,both` runs each row per launch mode (programmatic dependent launch as
comms.dispatch_fused chooses, on neither kernel, only the one named, or both); payload column
"<payload>/pdl-<mode>" unless auto;
`--blocks` sweeps the fused kernels' grid per row ("auto": sized per call from the token count);
`--phases` adds, per row, when the latest block passed each phase boundary of the last dispatch and
combine of a probed pair replay (rank 0; us after the dispatch's first block started, the combine's
"first" is its first block's start; %globaltimer stamps).
A dispatch-only replay loop reuses buffers that a peer one call ahead already rewrites, so its numbers
are timings only; the pair loop is the real sequence.
Prints an nccl-tests-style table on rank 0 and writes JSON (`--json`).
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from perf.comms.timing import capture_loop, events_time, loop, max_over_ranks, warm_on_side_stream


def add_arguments(p):
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096",
                   help="tokens per rank, comma-separated")
    p.add_argument("--hidden", default="4096,7168")
    p.add_argument("--experts", default="128,256")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--layout", default="contiguous", choices=("masked", "contiguous"),
                   help="packed expert-input layout (masked needs E_local * world * max tokens rows)")
    p.add_argument("--iters", type=int, default=20, help="ops per CUDA-graph replay")
    p.add_argument("--nccl-iters", type=int, default=5)
    p.add_argument("--nprocs", type=int, default=0, help="GPUs (default: all visible)")
    p.add_argument("--json", default="", help="write results here (rank 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="whole run, seconds")
    p.add_argument("--blocks", default="auto",
                   help="fused grid per row, comma-separated block counts or 'auto' (sized per call)")
    p.add_argument("--phases", action="store_true",
                   help="also print per-phase times of one probed pair replay per row (rank 0)")
    p.add_argument("--payload", default="bf16", help="dispatch payloads, comma-separated: bf16, mxfp8")
    p.add_argument("--pipeline", default="1", help="pipeline_phases values, comma-separated (1: not pipelined)")
    p.add_argument("--send-warps", default="2", help="pipelined rows: warps per block sending while the others pack, "
                   "comma-separated (0: send, then pack)")
    p.add_argument("--overlap", default="auto",
                   help="overlap settings, comma-separated: auto, 0, 1 (see comms.dispatch_fused)")
    p.add_argument("--pdl", default="auto",
                   help="programmatic dependent launch per row, comma-separated: auto (comms.dispatch_fused's "
                        "DISPATCH_PDL / COMBINE_PDL), none, dispatch, combine (only that kernel), both")
    p.add_argument("--skip-nccl", action="store_true", help="leave out the NCCL reference path columns (0)")
    p.add_argument("--heap", default="auto", choices=("auto", "comms", "torch"),
                   help="symmetric memory: comms.SymmetricHeap, torch symmetric memory, or auto (comms if it works)")


class TorchSymmHeap:
    """The slice of the `comms.SymmetricHeap` API that DispatchCombine uses, over torch's symmetric
    memory (multicast off). A fallback for hosts where the cuMem heap cannot be set up, so the
    kernels can still be measured; chosen once by `make_heap` and printed."""

    def __init__(self, group, nbytes: int, device):
        import torch.distributed._symmetric_memory as symm

        self.group, self.device = group, torch.device(device)
        self.rank, self.world_size, self.nbytes = dist.get_rank(group), dist.get_world_size(group), nbytes
        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(group.group_name)
        self._buf = symm.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._handle = symm.rendezvous(self._buf, group.group_name)
        self.peer_ptrs = torch.tensor(list(self._handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        self.used = 0

    def alloc(self, nbytes: int, *, align: int = 256) -> int:
        off = -(-self.used // align) * align
        if off + nbytes > self.nbytes:
            raise RuntimeError(f"TorchSymmHeap: alloc({nbytes}) past {self.nbytes} bytes")
        self._buf[off:off + nbytes].zero_()
        self.used = off + nbytes
        return off

    def buffer(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """This rank's bytes [offset, ...) viewed as `shape`/`dtype` (as SymmetricHeap.buffer)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self._buf[offset:offset + n].view(dtype).view(shape)

    def barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def destroy(self) -> None:
        self._buf = self._handle = self.peer_ptrs = None


def make_heap(kind: str, group, nbytes: int, device):
    """kind "comms" (comms.SymmetricHeap) or "torch" (TorchSymmHeap)."""
    if kind == "torch":
        return TorchSymmHeap(group, nbytes, device)
    from comms.heap import SymmetricHeap

    return SymmetricHeap(group, nbytes, device=device, timeout_s=30)


def pick_heap(group, device) -> str:
    """"comms" when a small comms.SymmetricHeap comes up on every rank, else "torch"."""
    ok = torch.ones(1, device=device)
    try:
        make_heap("comms", group, 1 << 21, device).destroy()
    except Exception as e:  # noqa: BLE001  (printed; the fallback is chosen on every rank)
        print(f"rank {dist.get_rank(group)}: comms.SymmetricHeap failed ({type(e).__name__}: {e})", flush=True)
        ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return "comms" if bool(ok) else "torch"


def _ints(s):
    return [int(v) for v in str(s).split(",") if v]


def _blocks(s):
    """'auto,16,132' -> [None, 16, 132] (None: the fused path sizes the grid per call)."""
    out = []
    for v in str(s).split(","):
        if v == "auto":
            out.append(None)
        elif v:
            if int(v) < 1:
                raise ValueError(f"--blocks value {v!r}: a block count >= 1 or 'auto'")
            out.append(int(v))
    return out


def _choices(s, flag, allowed):
    """'a,b' -> ['a', 'b'], each checked against `allowed` (the error names --flag and the value)."""
    out = [v for v in str(s).split(",") if v]
    for v in out:
        if v not in allowed:
            raise ValueError(f"--{flag} value {v!r}: expected one of {tuple(allowed)}")
    return out


def _overlaps(s):
    """'auto,0,1' -> [None, False, True] (None: the fused path decides per call)."""
    names = {"auto": None, "0": False, "1": True}
    return [names[v] for v in _choices(s, "overlap", names)]


PDL_MODES = {"auto": (None, None), "none": (False, False), "dispatch": (True, False), "combine": (False, True),
             "both": (True, True)}


def _pdls(s):
    """'auto,none' -> ['auto', 'none'] (keys of PDL_MODES: FusedDispatch.set_pdl's arguments)."""
    return _choices(s, "pdl", PDL_MODES)


def _payloads(s):
    """'bf16,mxfp8' -> ['bf16', 'mxfp8'] (checked against comms.dispatch.PAYLOADS)."""
    from comms.dispatch import PAYLOADS

    return _choices(s, "payload", PAYLOADS)


def _phase_line(T, blocks, times):
    """'#   phases T=128 blocks=auto(128) dispatch: tables sent 3.1 ... | combine: ...' (us)."""
    return f"#   phases T={T} blocks={blocks}: " + " | ".join(
        f"{k}: " + " ".join(f"{n} {t:.1f}" for n, t in times[k]) for k in ("dispatch", "combine"))


def _sendrecv_bw(rank, world, dev, nbytes=256 << 20, reps=5):
    """Bytes/s one GPU pushes to its ring neighbour while receiving from the other (NCCL p2p)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def once():
        ops = [dist.P2POp(dist.isend, a, nxt), dist.P2POp(dist.irecv, b, prv)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
    once()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        once()
    torch.cuda.synchronize()
    bw = torch.tensor([nbytes * reps / (time.perf_counter() - t0)], device=dev)
    dist.all_reduce(bw, op=dist.ReduceOp.MIN)
    return float(bw)


def _graph_time(fn, iters, dev):
    """Capture `iters` calls of fn in one graph; seconds per call of a warm replay (max over ranks).

    If capture fails, the same loop runs eagerly (timed with events) and `eager` is returned True."""
    warm_on_side_stream(fn)
    eager = False
    try:
        run = capture_loop(fn, iters).replay
    except Exception as e:  # noqa: BLE001  (reported in the table)
        print(f"graph capture failed ({type(e).__name__}: {e}); timing eagerly", flush=True)
        eager = True
        run = loop(fn, iters)
    run()
    return max_over_ranks(events_time(run) / iters, dev), eager


def _event_time(fn, iters, dev):
    """Seconds per call of `iters` eager calls queued back to back (events; max over ranks)."""
    fn()
    return max_over_ranks(events_time(loop(fn, iters)) / iters, dev)


def _wall_median(fn, reps, dev):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(ts)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(rank, world, store, args, out_path):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout), device_id=dev)
    from comms.dispatch import DispatchCombine, token_rank_mask
    from comms.dispatch_fused import staged_row_bytes

    group = dist.group.WORLD
    K = args.topk
    heap_kind = args.heap if args.heap != "auto" else pick_heap(group, dev)
    if rank == 0:
        print(f"# heap: {heap_kind}", flush=True)
    bw = _sendrecv_bw(rank, world, dev)
    if rank == 0:
        print(f"# NCCL send/recv (ring neighbour, both directions at once): {bw / 1e9:.1f} GB/s per GPU", flush=True)
    rows = []
    tokens = _ints(args.tokens)
    M = max(tokens)
    gen = torch.Generator(device=dev).manual_seed(1 + rank)
    try:
        for H, E, payload, pipe in [(H, E, pl, pp) for H in _ints(args.hidden) for E in _ints(args.experts)
                                    for pl in _payloads(args.payload) for pp in _ints(args.pipeline)]:
            heap = make_heap(heap_kind, group, DispatchCombine.heap_size_hint(world, E, K, H, M, payload, pipe), dev)
            fused = DispatchCombine(heap, E, K, H, M, mode="dp_ep", layout=args.layout, payload=payload,
                                    pipeline_phases=pipe)
            ref = DispatchCombine(group, E, K, H, M, mode="dp_ep", layout=args.layout)
            wire = staged_row_bytes(H, payload)  # bytes of one row in flight
            sends = _ints(args.send_warps) if pipe > 1 else [0]
            overlaps = _overlaps(args.overlap)
            for T, blocks, sw, ov, pdl in [(T, b, sw, ov, pdl) for T in tokens for b in _blocks(args.blocks)
                                           for sw in sends for ov in overlaps for pdl in _pdls(args.pdl)]:
                label = payload + (f"/p{pipe}w{sw}" if pipe > 1 else "") + ("" if ov is None else f"/ov{int(ov)}")
                label += "" if pdl == "auto" else f"/pdl-{pdl}"
                fused._fused.set_overlap(ov)
                fused._fused.set_pdl(*PDL_MODES[pdl])
                if pipe > 1:
                    fused._fused.set_phases(None, sw)
                fused._fused.set_blocks(blocks)
                nb = fused._fused.blocks_for(T)
                bname = f"auto({nb})" if blocks is None else str(nb)
                x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
                ids = torch.rand(T, E, device=dev, generator=gen).topk(K, dim=1).indices.to(torch.int32)
                w = torch.rand(T, K, device=dev, generator=gen)
                w = w / w.sum(1, keepdim=True)
                recv, h = fused.dispatch(x, ids, w)
                # expert outputs are bf16 whatever the dispatch payload (an MXFP8 payload's rows are fp8)
                y = recv.x if recv.x.dtype == torch.bfloat16 else torch.randn(
                    recv.x.shape, device=dev, generator=gen).to(torch.bfloat16)
                fused.combine(y, h)
                fused.check()
                t_d, eager = _graph_time(lambda: fused.dispatch(x, ids, w), args.iters, dev)
                fused.check()

                def pair():
                    r, hh = fused.dispatch(x, ids, w)
                    fused.combine(r.x if r.x.dtype == torch.bfloat16 else y, hh)

                t_dc, _ = _graph_time(pair, args.iters, dev)
                fused.check()
                t_c = max(t_dc - t_d, 0.0)
                phases = None
                if args.phases:  # a separate capture: the probe address is a kernel argument
                    fused._fused.enable_probes()
                    _graph_time(pair, args.iters, dev)
                    phases = fused._fused.phase_times()
                    fused._fused.enable_probes(False)
                    fused.check()
                state = {}

                def nccl_dispatch():
                    state["r"] = ref.dispatch(x, ids, w)

                t_nd = t_nc = 0.0
                if not args.skip_nccl:
                    t_nd = _wall_median(nccl_dispatch, args.nccl_iters, dev)
                    rr, hr = state["r"]
                    t_nc = _wall_median(lambda: ref.combine(rr.x, hr), args.nccl_iters, dev)
                # rows that cross ranks, and the a2a that moves exactly them
                mask = token_rank_mask(ids, E // world, world)  # [T, R]
                mask[:, rank] = False
                remote = torch.tensor([int(mask.sum())], device=dev)
                dist.all_reduce(remote, op=dist.ReduceOp.MAX)
                send_counts = mask.sum(0).tolist()
                rc = torch.tensor(send_counts, device=dev)
                recv_counts = torch.empty_like(rc)
                dist.all_to_all_single(recv_counts, rc)
                recv_counts = recv_counts.tolist()
                dst, tok = torch.nonzero(mask.t(), as_tuple=True)
                sbuf = x[tok].contiguous()
                rbuf = torch.empty(sum(recv_counts), H, dtype=x.dtype, device=dev)
                t_a2a = _event_time(lambda: dist.all_to_all_single(rbuf, sbuf, recv_counts, send_counts),
                                    args.iters, dev)
                nbytes = int(remote) * wire
                floor = nbytes / bw
                rows.append(dict(tokens=T, hidden=H, experts=E, topk=K, world=world, layout=args.layout,
                                 payload=payload, pipeline_phases=pipe, send_phases=fused._fused.phases_for(T), send_warps=sw,
                                 overlap=fused._fused.overlap_for(T), pdl=pdl,
                                 graph=not eager,
                                 blocks=nb, blocks_auto=blocks is None, phases=phases,
                                 fused_dispatch_us=t_d * 1e6, fused_combine_us=t_c * 1e6,
                                 fused_pair_us=t_dc * 1e6, nccl_dispatch_us=t_nd * 1e6,
                                 nccl_combine_us=t_nc * 1e6, nccl_a2a_rows_us=t_a2a * 1e6,
                                 remote_bytes=nbytes, floor_us=floor * 1e6, sendrecv_GBps=bw / 1e9,
                                 dispatch_GBps=nbytes / t_d / 1e9 if t_d else 0.0,
                                 combine_GBps=nbytes / t_c / 1e9 if t_c else 0.0))
                if rank == 0:
                    r = rows[-1]
                    print(f"{T:6d} {H:6d} {E:4d} {label:>8s} {bname:>9s} {r['fused_dispatch_us']:9.1f} {r['fused_combine_us']:9.1f} "
                          f"{r['fused_pair_us']:9.1f} {r['nccl_dispatch_us']:9.1f} {r['nccl_combine_us']:9.1f} "
                          f"{(r['nccl_dispatch_us'] + r['nccl_combine_us']) / r['fused_pair_us']:6.1f}x "
                          f"{r['nccl_a2a_rows_us']:9.1f} {r['floor_us']:8.1f} {r['dispatch_GBps']:7.1f} "
                          f"{r['combine_GBps']:7.1f} {100 * r['dispatch_GBps'] / r['sendrecv_GBps']:5.0f}%"
                          f"{'' if r['graph'] else ' (eager)'}",
                          flush=True)
                    if phases:
                        print(_phase_line(T, f"{bname} {label}", phases), flush=True)
            fused.destroy()
            heap.destroy()
    finally:
        if rank == 0 and out_path:
            with open(out_path, "w") as f:
                json.dump({"sendrecv_GBps": bw / 1e9, "gpu": torch.cuda.get_device_name(dev), "world": world,
                           "rows": rows}, f, indent=1)
        dist.destroy_process_group()


HEADER = ("tokens hidden    E  payload    blocks  disp(us)  comb(us)  pair(us) ncclD(us) ncclC(us) speedup"
          "  a2a(us) floor(us) dispGB/s combGB/s %sendrecv")


def run(args) -> int:
    world = args.nprocs or torch.cuda.device_count()
    if world < 2:
        raise RuntimeError(f"dispatch benchmark needs >= 2 GPUs, found {world}")
    print(f"# fused DP-EP dispatch/combine vs NCCL, {world} x {torch.cuda.get_device_name(0)}, top-{args.topk}, "
          f"payload {args.payload}, layout {args.layout}, {args.iters} ops per graph replay")
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.spawn(_worker, args=(world, os.path.join(d, "store"), args, args.json), nprocs=world, join=False)
        t0 = time.monotonic()
        while not ctx.join(timeout=5):
            if time.monotonic() - t0 > args.timeout:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"dispatch benchmark did not finish within --timeout {args.timeout} s")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
