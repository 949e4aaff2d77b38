"""Fused DP-EP dispatch/combine kernels == the torch.distributed reference, bit for bit (>= 2 GPUs).

Each rank runs the fused path (SymmetricHeap + CuTeDSL kernels) and the NCCL all_to_all reference
on the same rank-tagged inputs and compares: per-expert counts and offsets, every packed row (data,
source rank, source token, weight) and the combine output, all exactly; for the MXFP8 payload the
packed E4M3 bytes and E8M0 scale bytes (quantized in the dispatch kernel) against the reference's
torch quantization, and combine of the dequantized rows; both dispatch modes (overlap on / off,
differing across ranks within an epoch); the pipelined dispatch with send phases that differ across
ranks and calls, overlap on and off among them. Also: several epochs on one
buffer, CUDA-graph capture and replay with fresh inputs, the capacity error, and the bounded wait
(a peer that never arrives gives DispatchTimeoutError instead of a hung GPU).

Runs under pytest (skipped without 2 GPUs) or directly, `python tests/comms/test_dispatch_gpu.py`,
which prints one line per check (the GPU hosts need no pytest)."""
from __future__ import annotations

import datetime
import os
import re
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.comms.test_dispatch_inputs import CASES, routing, tagged_tokens

try:
    import pytest
except ImportError:  # the GPU hosts run this file as a script
    pytest = None

TIMEOUT_S = 120
PEER = r"rank [1-9][0-9]*"  # a timeout on rank 0 names one of the peers that never came (any, at > 2 ranks)
# (experts, top_k, hidden, max_tokens, tokens per rank (rank 0, rank 1, ...), cases, layouts, payloads)
CONFIGS = [
    (16, 4, 1024, 64, (37, 64), CASES, ("masked", "contiguous"), ("bf16", "mxfp8")),
    (16, 4, 1024, 64, (0, 1), ("random",), ("masked",), ("bf16", "mxfp8")),
    (128, 8, 4096, 128, (128, 100), ("random", "same_rank_slots"), ("masked", "contiguous"), ("bf16", "mxfp8")),
    (256, 8, 7168, 32, (32, 17), ("random",), ("contiguous",), ("bf16", "mxfp8")),
    (128, 8, 4096, 1024, (1024, 400), ("random",), ("contiguous",), ("bf16", "mxfp8")),
]
# overlap per epoch (it0, it1) of the exact checks, per rank parity: each rank runs both modes, and
# the ranks disagree in each epoch (the protocol allows any mix); the last config also runs the
# default (None: by token count, so rank 0's 1024 tokens overlap and rank 1's 400 do not: the bound,
# comms.dispatch_fused.OVERLAP_MIN_TOKENS, is 512)
OVERLAP = ((True, False), (False, True))


def _expert_in(recv):
    """Identity experts' input: recv.x (bf16), or the dequantized MXFP8 rows rounded to bf16 (exact)."""
    if recv.scales is None:
        return recv.x
    from comms import mxfp8

    return mxfp8.dequantize(recv.x, recv.scales).to(torch.bfloat16)


def _compare(rank, fused, ref, x, ids, w, tag):
    """Dispatch and combine (identity experts) on both paths, then compare bitwise.

    Every rank runs the same sequence of collective calls whatever it finds, so a mismatch on one
    rank cannot desynchronise the others; returns (entries, [failure messages])."""
    rf, hf = fused.dispatch(x, ids, w)
    rr, hr = ref.dispatch(x, ids, w)
    of = fused.combine(_expert_in(rf), hf)
    orf = ref.combine(_expert_in(rr), hr)
    errs = []
    try:
        fused.check()
    except Exception as e:  # noqa: BLE001  (reported with the case's tag)
        errs.append(f"{type(e).__name__}: {e}")
    if not torch.equal(rf.counts.cpu(), rr.counts.cpu()):
        errs.append(f"counts {rf.counts.tolist()} != {rr.counts.tolist()}")
    if not torch.equal(rf.offsets.cpu(), rr.offsets.cpu()):
        errs.append(f"offsets {rf.offsets.tolist()} != {rr.offsets.tolist()}")
    H = x.shape[1]
    fx, rx = rf.x.reshape(-1, H), rr.x.reshape(-1, H)  # [rows, H]
    data = [("x", fx, rx)]
    if rr.scales is not None:  # compare bytes: E4M3 NaN != NaN
        data = [("x (E4M3 bytes)", fx.view(torch.uint8), rx.view(torch.uint8)),
                ("scales (E8M0 bytes)", rf.scales.reshape(-1, H // 32), rr.scales.reshape(-1, H // 32))]
    idx = torch.cat([torch.arange(int(o), int(o) + int(c)) for o, c in zip(rr.offsets[:-1].tolist(),
                                                                          rr.counts.tolist())] or
                    [torch.empty(0, dtype=torch.long)]).to(x.device)
    for name, a, b in [(n, f[idx], r[idx]) for n, f, r in data] + [
            ("src_rank", rf.src_rank[idx], rr.src_rank[idx]), ("src_token", rf.src_token[idx], rr.src_token[idx]),
            ("weights", rf.weights[idx], rr.weights[idx])]:
        bad = (a != b).reshape(a.shape[0], -1).any(1) if a.numel() else a.new_zeros(0, dtype=torch.bool)
        if bad.any():
            first = int(torch.nonzero(bad)[0])
            errs.append(f"packed {name}: {int(bad.sum())} of {a.shape[0]} rows differ (first: packed row "
                        f"{int(idx[first])}, from rank {int(rr.src_rank[idx[first]])} token "
                        f"{int(rr.src_token[idx[first]])}; fused gave rank {int(rf.src_rank[idx[first]])} "
                        f"token {int(rf.src_token[idx[first]])})")
    nbad = int((of != orf).sum())
    if nbad:
        t = int(torch.nonzero((of != orf).any(1))[0])
        errs.append(f"combine differs in {nbad} of {of.numel()} values (first token {t}: "
                    f"{of[t, :4].tolist()} vs {orf[t, :4].tolist()})")
    if x.shape[0]:
        xin = x
        if rr.scales is not None:  # the identity experts saw the dequantized rows
            from comms import mxfp8

            xin = mxfp8.dequantize(*mxfp8.quantize(x))
        exact = (xin.float()[:, None, :] * w.float()[:, :, None]).sum(1)
        rel = float((of.float() - exact).norm() / exact.norm())
        if not rel < 1e-2:
            errs.append(f"combine vs fp32 sum_k w_k x: rel err {rel}")
    return int(idx.numel()), [f"rank {rank} {tag}: {e}" for e in errs]


def _graph_check(rank, world, fused, ref, E, K, H, T, gen):
    """Capture dispatch + combine once, replay on fresh inputs, compare with the reference."""
    dev = torch.device("cuda", rank)
    sx = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
    sids = torch.zeros(T, K, dtype=torch.int32, device=dev)
    sw = torch.zeros(T, K, dtype=torch.float32, device=dev)
    x, ids, w = _inputs("random", rank, world, T, E, K, H, gen, dev)
    sx.copy_(x), sids.copy_(ids), sw.copy_(w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        recv, h = fused.dispatch(sx, sids, sw)
        fused.combine(_expert_in(recv), h)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        recv, h = fused.dispatch(sx, sids, sw)
        out = fused.combine(_expert_in(recv), h)
    errs = []
    for it in range(3):
        x, ids, w = _inputs("random", rank, world, T, E, K, H, gen, dev)
        sx.copy_(x), sids.copy_(ids), sw.copy_(w)
        g.replay()
        rr, hr = ref.dispatch(x, ids, w)
        orf = ref.combine(_expert_in(rr), hr)
        try:
            fused.check()
        except Exception as e:  # noqa: BLE001
            errs.append(f"replay {it}: {type(e).__name__}: {e}")
        if not torch.equal(recv.counts.cpu(), rr.counts.cpu()):
            errs.append(f"replay {it}: counts differ")
        nbad = int((out != orf).sum())
        if nbad:
            errs.append(f"replay {it}: combine differs in {nbad} values")
    return [f"rank {rank} graph T={T}: {e}" for e in errs]


def _expect_raise(fn, exc, pattern):
    try:
        fn()
    except exc as e:
        assert re.search(pattern, str(e)), f"{exc.__name__} message {e!r} does not match {pattern!r}"
        return
    raise AssertionError(f"expected {exc.__name__}")


def _inputs(case, rank, world, T, E, K, H, gen, dev):
    x = tagged_tokens(rank, T, gen, hidden=H).to(dev)
    ids, w = routing(case, rank, world, T, E, gen, topk=K)
    return x, ids.to(dev).to(torch.int32), w.to(dev)


def _worker(rank, world, store_path, log):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S), device_id=dev)
    from comms.dispatch import CapacityError, DispatchCombine, DispatchTimeoutError
    from perf.comms.dispatch import make_heap, pick_heap

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(7 + rank)
    lines, failures = [], []

    def note(msg):
        if rank == 0:
            lines.append(msg)
            print(msg, flush=True)

    def report(errs, what):
        """Print this rank's failures, keep them, and note one PASS/FAIL line for the check."""
        for e in errs:
            print("FAIL", e, flush=True)
        failures.extend(errs)
        note(f"{'FAIL' if errs else 'PASS'} {what}")

    kind = os.environ.get("DISPATCH_TEST_HEAP") or pick_heap(group, dev)
    note(f"heap: {kind}")


    try:
        for E, K, H, M, toks, cases, layouts, payloads in CONFIGS:
            T = toks[rank % len(toks)]
            for layout, pl in [(lay, pl) for pl in payloads for lay in layouts]:
                heap = make_heap(kind, group, DispatchCombine.heap_size_hint(world, E, K, H, M, pl), dev)
                fused = DispatchCombine(heap, E, K, H, M, mode="dp_ep", layout=layout, timeout_s=5.0, payload=pl)
                ref = DispatchCombine(group, E, K, H, M, mode="dp_ep", layout=layout, payload=pl)
                assert fused._fused is not None, "heap on CUDA must select the fused kernels"
                for case in cases:
                    t0 = time.perf_counter()
                    n, errs = 0, []
                    modes = OVERLAP + (((None, None),) if M >= 1024 else ())
                    for it, ov in enumerate(modes):  # epochs on the same buffers
                        fused._fused.set_overlap(ov[rank % 2])
                        x, ids, w = _inputs(case, rank, world, T, E, K, H, gen, dev)
                        m, e = _compare(rank, fused, ref, x, ids, w, f"E={E} K={K} H={H} T={T} {layout} {case} it{it} "
                                        f"overlap={fused._fused.overlap_for(T)}")
                        n, errs = n + m, errs + e
                    fused._fused.set_overlap(None)
                    report(errs, f"exact  E={E:3d} K={K} H={H} M={M} T={T:3d} {layout:10s} {pl:5s} "
                                 f"{case:15s} entries={n} ({time.perf_counter() - t0:.2f}s)")
                if layout == layouts[0] and E == 128 and M < 1024:
                    for ov in (None, True):  # by token count (here: no overlap), then overlap forced
                        fused._fused.set_overlap(ov)
                        try:
                            errs = _graph_check(rank, world, fused, ref, E, K, H, T, gen)
                        except Exception as e:  # noqa: BLE001  (capture itself failed: report, go on)
                            errs = [f"rank {rank} graph capture: {type(e).__name__}: {e}"]
                        report(errs, f"graph  E={E} K={K} H={H} T={T} {layout} {pl} overlap={ov}: "
                                     f"capture once, 3 replays on fresh inputs == reference")
                    fused._fused.set_overlap(None)
                fused.destroy()
                heap.destroy()
        # grids differ across ranks and calls (one arrival per source and epoch): rank 0 launches 1 block,
        # then 5, the others size their grids per call
        E, K, H, M = 128, 8, 4096, 128
        T = (128, 100)[rank % 2]
        heap = make_heap(kind, group, DispatchCombine.heap_size_hint(world, E, K, H, M), dev)
        fused = DispatchCombine(heap, E, K, H, M, mode="dp_ep", layout="contiguous", timeout_s=5.0)
        ref = DispatchCombine(group, E, K, H, M, mode="dp_ep", layout="contiguous")
        errs, grids = [], []
        for it, nb in enumerate((1, 5)):
            fused._fused.set_blocks(nb if rank == 0 else None)
            fused._fused.set_overlap((it + rank) % 2 == 0)  # the block-per-expert scan on 1 and 5 blocks
            grids.append(fused._fused.blocks_for(T))
            x, ids, w = _inputs("random", rank, world, T, E, K, H, gen, dev)
            errs += _compare(rank, fused, ref, x, ids, w, f"grids E={E} T={T} it{it} blocks={grids[-1]}")[1]
        report(errs, f"grids  E={E} K={K} H={H}: rank 0 with {grids} blocks, "
                     f"the others sized per call, == reference")
        fused.destroy()
        heap.destroy()
        # capacity overflow -> CapacityError (rank 1 holds every token's experts)
        E, K, H, M = 16, 4, 1024, 64
        heap = make_heap(kind, group, DispatchCombine.heap_size_hint(world, E, K, H, M), dev)
        fused = DispatchCombine(heap, E, K, H, M, mode="dp_ep", expert_capacity=4)
        x, ids, w = _inputs("one_rank", rank, world, 40, E, K, H, gen, dev)
        fused.dispatch(x, ids, w)
        if rank == 1:
            _expect_raise(fused.check, CapacityError, "expert capacity 4")
        else:
            fused.check()
        note("PASS capacity overflow -> CapacityError on the overflowing rank")
        fused.destroy()
        heap.destroy()
        # bounded wait: only rank 0 dispatches; it must time out and raise, not hang
        heap = make_heap(kind, group, DispatchCombine.heap_size_hint(world, E, K, H, M), dev)
        fused = DispatchCombine(heap, E, K, H, M, mode="dp_ep", timeout_s=0.5)
        if rank == 0:
            x, ids, w = _inputs("random", rank, world, 8, E, K, H, gen, dev)
            t0 = time.perf_counter()
            fused.dispatch(x, ids, w)
            _expect_raise(fused.check, DispatchTimeoutError, PEER)
            note(f"PASS timeout -> DispatchTimeoutError after {time.perf_counter() - t0:.2f}s")
            fused._fused.err.zero_()  # overlap: the tables wait times out first, then the rows wait
            fused._fused.set_overlap(True)
            t0 = time.perf_counter()
            fused.dispatch(x, ids, w)
            _expect_raise(fused.check, DispatchTimeoutError, PEER)
            note(f"PASS timeout (overlap) -> DispatchTimeoutError after {time.perf_counter() - t0:.2f}s")
        dist.barrier()
        fused.destroy()
        heap.destroy()
        # bounded combine wait: every rank dispatches, only rank 0 combines; its sums wait for the
        # peers' partials and must time out naming a peer, not hang
        heap = make_heap(kind, group, DispatchCombine.heap_size_hint(world, E, K, H, M), dev)
        fused = DispatchCombine(heap, E, K, H, M, mode="dp_ep", timeout_s=0.5)
        x, ids, w = _inputs("random", rank, world, 8, E, K, H, gen, dev)
        recv, h = fused.dispatch(x, ids, w)
        fused.check()
        if rank == 0:
            t0 = time.perf_counter()
            fused.combine(recv.x, h)
            _expect_raise(fused.check, DispatchTimeoutError, "combine wait: " + PEER)
            note(f"PASS combine timeout -> DispatchTimeoutError after {time.perf_counter() - t0:.2f}s")
        dist.barrier()
        fused.destroy()
        heap.destroy()
        # pipelined dispatch, last (gpu_dispatch_sweep.sh still times the others if only this fails):
        # send phases and send warps differ across ranks and calls (one phase too), == reference
        for E, K, H, M, Ts, layout in ((16, 4, 1024, 64, (64, 37), "masked"),
                                        (128, 8, 4096, 512, (512, 300), "contiguous")):
            T = Ts[rank % len(Ts)]
            for pl in ("bf16",):  # the pipelined MXFP8 dispatch is refused for now (comms.dispatch_fused)
                heap = make_heap(kind, group, DispatchCombine.heap_size_hint(world, E, K, H, M, pl, 4), dev)
                fused = DispatchCombine(heap, E, K, H, M, mode="dp_ep", layout=layout, timeout_s=5.0, payload=pl,
                                        pipeline_phases=4)
                ref = DispatchCombine(group, E, K, H, M, mode="dp_ep", layout=layout, payload=pl)
                errs, used = [], []
                # (phases, send warps, overlap) per rank parity; overlap differs across ranks and calls
                for it, (phases, sw, ov) in enumerate((((4, 2), (2, 0), (False, True)),
                                                       ((None, None), (0, 4), (True, True)),
                                                       ((1, 3), (3, 2), (True, False)),
                                                       ((1, 1), (2, 2), (None, True)),
                                                       ((4, 4), (0, 2), (True, True)))):
                    fused._fused.set_phases(phases[rank % 2], sw[rank % 2])
                    fused._fused.set_overlap(ov[rank % 2])
                    used.append((fused._fused.phases_for(T), sw[rank % 2], int(fused._fused.overlap_for(T))))
                    x, ids, w = _inputs("random", rank, world, T, E, K, H, gen, dev)
                    errs += _compare(rank, fused, ref, x, ids, w, f"pipe E={E} T={T} {layout} {pl} phases={used[-1]}")[1]
                report(errs, f"pipe   E={E:3d} K={K} H={H} T={T:3d} {layout:10s} {pl:5s} (phases, send warps, overlap) "
                             f"{used} == reference")
                fused.destroy()
                heap.destroy()
        if failures:
            raise AssertionError(f"rank {rank}: {len(failures)} failures, first: {failures[0]}")
    finally:
        if rank == 0 and log:
            with open(log, "w") as f:
                f.write("\n".join(lines) + "\n")
        dist.destroy_process_group()


def run(world: int, log: str | None = None):
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.spawn(_worker, args=(world, os.path.join(d, "store"), log), nprocs=world, join=False)
        t0 = time.monotonic()
        while not ctx.join(timeout=5):
            if time.monotonic() - t0 > TIMEOUT_S * 2:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"GPU dispatch workers did not finish within {TIMEOUT_S * 2} s")


if pytest is not None:
    @pytest.mark.gpu
    @pytest.mark.multigpu
    @pytest.mark.mp
    def test_fused_dispatch_matches_reference():
        run(2)


if __name__ == "__main__":
    run(int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count(),
        sys.argv[2] if len(sys.argv) > 2 else None)
