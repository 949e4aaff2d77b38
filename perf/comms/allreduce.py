"""All-reduce: our kernels beside NCCL and torch symmetric memory, eager and CUDA-graph replay.

    python -m perf.comms allreduce [--nproc 2] [--dtype bf16] [--min-bytes 1K --max-bytes 128M]
                                   [--blocks auto,132,256] [--repeat 5] [--json out.json]

One process per GPU (spawned here, NCCL group). For every size (powers of 2) and every
algorithm: time per all-reduce (max over ranks of the mean over `iters` back-to-back calls),
algbw = bytes / time and busbw = algbw * 2(W-1)/W (the nccl-tests convention). Peers:
`torch.ops.symm_mem.one_shot_all_reduce` and `two_shot_all_reduce_` on a torch symmetric-memory
buffer (their best case: input already symmetric), NCCL `all_reduce`. Also: peer-copy bandwidth
(a local tensor copied into a peer's heap, over NVLink) and the fused all-reduce + add + RMSNorm
against the same steps as separate ops (the same all-reduce, torch add, torch rms_norm) at decode sizes. Multicast stays off (never created here).
`twoshot_pipe` is the pipelined two-shot (per-tile flags, overlapping phases) on the same ordinary
tensors as `twoshot`. `twoshot_symm` and `twoshot_push` get heap buffers (`symmetric_empty`), as
torch's ops get symmetric memory: twoshot_symm from one into another, twoshot_push in place (the
form of torch's two_shot_all_reduce_). `lamport_nopdl` is the Lamport kernel launched without
programmatic dependent launch (AllReduce(pdl=False)): the difference is what PDL saves.
`--blocks auto,132,...` runs each two-shot algorithm (GRID_ALGOS) once per grid: `auto` under its
own name (the default grid), a count as `<algo>@<count>` (AllReduce(blocks=count)). `--repeat N`
times every (size, algorithm) N times, interleaved across the algorithms so drift hits all alike;
times are the median of the N samples (all kept in the JSON). The output ends with a table of the
graph-replay times, one row per size and one column per algorithm, then, when torch_two_shot ran,
every two-shot time as a ratio to its time at the same size.
"""
from __future__ import annotations

import datetime
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from perf.comms.timing import capture_loop, events_time, loop, max_over_ranks, warm_on_side_stream

OURS = ("lamport", "lamport_nopdl", "oneshot", "twoshot", "twoshot_pipe")  # lamport_nopdl: AllReduce(pdl=False)
SYMM = ("twoshot_symm", "twoshot_push")  # our two-shots with x and out in the heap (as torch's ops get)
PEERS = ("nccl", "torch_one_shot", "torch_two_shot")
GRID_ALGOS = ("twoshot", "twoshot_pipe", "twoshot_symm", "twoshot_push")  # take AllReduce(blocks=)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _parse_bytes(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B")
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


def add_arguments(parser) -> None:
    parser.add_argument("--nproc", type=int, default=0, help="GPUs/processes (default: all visible)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--min-bytes", default="1K")
    parser.add_argument("--max-bytes", default="128M")
    parser.add_argument("--algos", default=",".join(OURS + SYMM + PEERS),
                        help=f"comma-separated subset of {','.join(OURS + SYMM + PEERS)}")
    parser.add_argument("--no-eager", action="store_true", help="graph replay only")
    parser.add_argument("--blocks", default="auto",
                        help=f"comma-separated grids for {','.join(GRID_ALGOS)}: auto (default grid) and/or block "
                             f"counts (rows <algo>@<count>)")
    parser.add_argument("--repeat", type=int, default=1, help="samples per size and algorithm (median reported)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound on the whole run")


def parse_blocks(spec: str) -> list[int | None]:
    """--blocks: 'auto' -> None (the default grid), a count -> that int (>= 1); order kept, no repeats."""
    out = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if tok == "auto":
            b = None
        elif tok.isdigit() and int(tok) >= 1:
            b = int(tok)
        else:
            raise SystemExit(f"--blocks: {tok!r} is neither 'auto' nor a block count >= 1")
        if b not in out:
            out.append(b)
    if not out:
        raise SystemExit(f"--blocks {spec!r}: no grid given")
    return out


def variants(algos: list[str], blocks: list[int | None]) -> list[tuple[str, str, int | None]]:
    """(label, algorithm, blocks) for every run: GRID_ALGOS once per grid (label `algo@count`, or
    `algo` for the default grid), the others once."""
    return [(a if b is None else f"{a}@{b}", a, b) for a in algos for b in (blocks if a in GRID_ALGOS else [None])]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def _time(fn, iters: int, graph: bool) -> float:
    """Mean seconds per call of fn over `iters` back-to-back calls (eager or one graph replay)."""
    if graph:
        warm_on_side_stream(fn)
        g = capture_loop(fn, iters)
        g.replay()
        t = events_time(g.replay) / iters
        del g
        return t
    for _ in range(3):
        fn()
    return events_time(loop(fn, iters)) / iters


def _worker(rank: int, world: int, init_file: str, cfg_json: str):
    cfg = json.loads(cfg_json)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=dev)
    from comms import AllReduce, HeapError, SymmetricHeap
    from comms.allreduce import rmsnorm_reference

    dtype = DTYPES[cfg["dtype"]]
    es = torch.empty((), dtype=dtype).element_size()
    sizes = []
    s = cfg["min_bytes"]
    while s <= cfg["max_bytes"]:
        sizes.append(s)
        s *= 2
    max_bytes = sizes[-1]
    runs = variants(cfg["algos"], cfg["blocks"])
    group = dist.group.WORLD
    from comms.allreduce import heap_bytes
    labels = {label for label, _, _ in runs}
    # one AllReduce per run of ours; twoshot_symm@b shares twoshot@b's when both run
    n_ours = sum(a in OURS or a == "twoshot_push" or (a == "twoshot_symm" and label.replace("_symm", "") not in labels)
                 for label, a, _ in runs)
    per_ar = heap_bytes(world, max_bytes)
    copy_bytes = 64 << 20  # peer-copy bandwidth region, apart from the all-reduce workspaces
    n_symm = ("twoshot_symm" in cfg["algos"]) * 2 + ("twoshot_push" in cfg["algos"])  # heap buffers of max_bytes
    heap = SymmetricHeap(group, n_ours * per_ar + n_symm * (max_bytes + (1 << 20)) + copy_bytes + (2 << 20), dev,
                         timeout_s=120)
    ars = {}
    for label, a, b in runs:
        if a in OURS:
            ars[label] = AllReduce(heap, a.removesuffix("_nopdl"), max_bytes=max_bytes, timeout_s=10,
                                   pdl=a != "lamport_nopdl", blocks=b)
    symm_bufs = {}  # algo -> (x, out) heap buffers of max_bytes, shared by its grids
    for label, a, b in runs:
        if a == "twoshot_symm":
            ars[label] = (ars.get(label.replace("_symm", ""))
                          or AllReduce(heap, "twoshot", max_bytes=max_bytes, timeout_s=10, blocks=b))
        elif a == "twoshot_push":
            ars[label] = AllReduce(heap, "twoshot_push", max_bytes=max_bytes, timeout_s=10, blocks=b)
    if "twoshot_symm" in cfg["algos"]:
        symm_bufs["twoshot_symm"] = tuple(heap.buffer(heap.alloc(max_bytes), (max_bytes // es,), dtype)
                                          for _ in range(2))
    if "twoshot_push" in cfg["algos"]:
        xp = heap.buffer(heap.alloc(max_bytes), (max_bytes // es,), dtype)
        symm_bufs["twoshot_push"] = (xp, xp)  # in place
    copy_off = heap.alloc(copy_bytes)
    symm = None
    if any(a.startswith("torch_") for a in cfg["algos"]):
        import torch.distributed._symmetric_memory as symm_mem
        symm = symm_mem.empty(max_bytes // es, dtype=dtype, device=dev)
        symm_mem.rendezvous(symm, group.group_name)
    results = []
    modes = ([] if cfg["no_eager"] else ["eager"]) + ["graph"]
    for nbytes in sizes:
        n = nbytes // es
        x = torch.randn(n, device=dev).to(dtype)
        ref = x.float().clone()
        dist.all_reduce(ref)
        iters = 50 if nbytes <= (1 << 20) else (20 if nbytes <= (16 << 20) else 5)
        fns = {}  # label -> (fn, row); each run checked against ref before the next one's setup
        for label, algo, _ in runs:
            if algo.startswith("lamport") and nbytes > ars[label].lam_cap:
                continue
            if algo in OURS:
                out = torch.empty_like(x)
                fn = (lambda ar=ars[label], out=out: ar(x, out=out))
                fn()
                torch.cuda.synchronize()
                got = out
            elif algo in SYMM:
                xs, os_ = (b[:n] for b in symm_bufs[algo])
                xs.copy_(x)
                fn = (lambda ar=ars[label], xs=xs, os_=os_: ar(xs, out=os_))
                fn()
                torch.cuda.synchronize()
                got = os_
            elif algo == "nccl":
                buf = x.clone()
                fn = (lambda buf=buf: dist.all_reduce(buf))
                got = None
            else:
                v = symm[:n]
                v.copy_(x)
                if algo == "torch_one_shot":
                    fn = (lambda v=v: torch.ops.symm_mem.one_shot_all_reduce(v, "sum", group.group_name))
                    got = fn()
                else:
                    fn = (lambda v=v: torch.ops.symm_mem.two_shot_all_reduce_(v, "sum", group.group_name))
                    fn()
                    got = v
                torch.cuda.synchronize()
            err = None
            if got is not None:
                err = ((got.float() - ref).norm() / ref.norm()).item()
            fns[label] = (fn, {"bytes": nbytes, "algo": label, "rel_err": err})
        samples = {(label, mode): [] for label in fns for mode in modes}
        for _ in range(cfg["repeat"]):  # interleaved: every run once per round
            for label, (fn, row) in fns.items():
                for mode in modes:
                    if f"{mode}_error" in row:
                        continue
                    try:
                        samples[label, mode].append(max_over_ranks(_time(fn, iters, mode == "graph")) * 1e6)
                    except RuntimeError as e:  # e.g. an op that cannot be captured: record, go on
                        row[f"{mode}_error"] = str(e).split("\n")[0][:200]
                        torch.cuda.synchronize()
                if label in ars:
                    ars[label].check()
        for label, (fn, row) in fns.items():
            for mode in modes:
                got = samples[label, mode]
                row[f"{mode}_us"] = _median(got) if got and f"{mode}_error" not in row else None
                row[f"{mode}_samples_us"] = got
            results.append(row)
    # peer-copy bandwidth: local -> peer heap (NVLink write) and local -> local (HBM)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    bw = {}
    targets = [("local_copy", torch.empty_like(src))]
    try:
        targets.insert(0, ("peer_write", heap.peer_buffer((rank + 1) % world, copy_off, (copy_bytes,), torch.uint8)))
    except HeapError as e:
        bw["peer_write"] = {"bytes": copy_bytes, "us": float("nan"), "GBps": float("nan"), "error": str(e)}
    for name, dst in targets:
        t = max_over_ranks(_time(lambda dst=dst: dst.copy_(src), 10, False))
        bw[name] = {"bytes": copy_bytes, "us": t * 1e6, "GBps": copy_bytes / t / 1e9}
    heap.barrier()
    # fused all-reduce + residual add + RMSNorm vs separate ops at decode sizes
    fused = []
    for algo in [a for a in ("lamport", "lamport_nopdl", "oneshot") if a in ars]:
        ar = ars[algo]
        for t_tok, h in ((1, 4096), (8, 4096), (32, 4096), (128, 4096), (32, 7168)):
            xx = torch.randn(t_tok, h, device=dev).to(dtype)
            res = torch.randn(t_tok, h, device=dev).to(dtype)
            w = torch.randn(h, device=dev).to(dtype)
            out_f = ar.add_rmsnorm(xx, res, w, 1e-6)

            def separate(xx=xx, res=res, w=w):
                s = ar(xx)
                r = s + res
                return torch.nn.functional.rms_norm(r, (h,), w, 1e-6), r
            out_s = separate()
            torch.cuda.synchronize()
            ref_n = rmsnorm_reference(out_s[1], w, 1e-6, False)
            row = {"algo": algo, "tokens": t_tok, "hidden": h,
                   "fused_rel_err": ((out_f[0].float() - ref_n.float()).norm() / ref_n.float().norm()).item()}
            for mode in modes:
                row[f"fused_{mode}_us"] = max_over_ranks(
                    _time(lambda: ar.add_rmsnorm(xx, res, w, 1e-6), 50, mode == "graph")) * 1e6
                row[f"separate_{mode}_us"] = max_over_ranks(_time(separate, 50, mode == "graph")) * 1e6
            fused.append(row)
    if rank == 0:
        out = {"gpu": torch.cuda.get_device_name(dev), "world": world, "dtype": cfg["dtype"], "repeat": cfg["repeat"],
               "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "capabilities": str(heap.capabilities), "allreduce": results, "peer_copy": bw,
               "add_rmsnorm": fused}
        with open(cfg["result_file"], "w") as f:
            json.dump(out, f)
    heap.barrier()
    for ar in set(ars.values()):
        ar.destroy()
    heap.destroy()
    dist.destroy_process_group()


def _fmt_table(res: dict) -> str:
    w = res["world"]
    lines = [f"# all-reduce, {res['world']} x {res['gpu']}, {res['dtype']}, torch {res['torch']}",
             f"# {res['capabilities']}",
             f"{'bytes':>11} {'algo':>18} {'eager_us':>10} {'graph_us':>10} {'algbw_GB/s':>11} {'busbw_GB/s':>11} "
             f"{'rel_err':>9}"]
    for r in res["allreduce"]:
        t = r.get("graph_us")
        algbw = r["bytes"] / (t * 1e-6) / 1e9 if t else float("nan")
        e = r.get("eager_us")
        lines.append(f"{r['bytes']:>11} {r['algo']:>18} {e if e is not None else float('nan'):>10.2f} "
                     f"{t if t is not None else float('nan'):>10.2f} {algbw:>11.2f} {algbw * 2 * (w - 1) / w:>11.2f} "
                     f"{r['rel_err'] if r['rel_err'] is not None else float('nan'):>9.2e}")
    for k, v in res["peer_copy"].items():
        lines.append(f"# {k}: {v['bytes']} bytes in {v['us']:.1f} us = {v['GBps']:.1f} GB/s")
    if res["add_rmsnorm"]:
        lines.append(f"{'algo':>13} {'tokens':>7} {'hidden':>7} {'fused_graph_us':>15} {'separate_graph_us':>18} "
                     f"{'speedup':>8}")
        for r in res["add_rmsnorm"]:
            lines.append(f"{r['algo']:>13} {r['tokens']:>7} {r['hidden']:>7} {r['fused_graph_us']:>15.2f} "
                         f"{r['separate_graph_us']:>18.2f} {r['separate_graph_us'] / r['fused_graph_us']:>8.2f}")
    return "\n".join(lines)


def _fmt_graph_pivot(res: dict) -> str:
    """Graph-replay us per all-reduce: a row per size, a column per algorithm ('-' = not run)."""
    algos = list(dict.fromkeys(r["algo"] for r in res["allreduce"]))
    t = {(r["bytes"], r["algo"]): r.get("graph_us") for r in res["allreduce"]}
    w = {a: max(14, len(a)) for a in algos}
    lines = ["# graph replay, us per all-reduce", f"{'bytes':>9} " + " ".join(f"{a:>{w[a]}}" for a in algos)]
    for b in sorted({r["bytes"] for r in res["allreduce"]}):
        lines.append(f"{b:>9} " + " ".join(f"{t[b, a]:>{w[a]}.2f}" if t.get((b, a)) is not None else f"{'-':>{w[a]}}"
                                           for a in algos))
    return "\n".join(lines)


def _fmt_vs(res: dict, peer: str = "torch_two_shot") -> str:
    """Each two-shot run's graph time / `peer`'s at the same size (medians), with the spread
    (min..max) of its samples; '' when the peer did not run."""
    rows = [r for r in res["allreduce"] if r.get("graph_us") is not None]
    ref = {r["bytes"]: r["graph_us"] for r in rows if r["algo"] == peer}
    if not ref:
        return ""
    lines = [f"# graph replay vs {peer} (median of {res.get('repeat', 1)}; ratio < 1: ours faster)",
             f"{'bytes':>10} {'algo':>18} {'us':>9} {'min..max':>17} {peer + '_us':>18} {'ratio':>7}"]
    for r in rows:
        if r["bytes"] in ref and r["algo"].split("@")[0] in GRID_ALGOS:
            xs = r.get("graph_samples_us") or [r["graph_us"]]
            lines.append(f"{r['bytes']:>10} {r['algo']:>18} {r['graph_us']:>9.2f} "
                         f"{f'{min(xs):.1f}..{max(xs):.1f}':>17} {ref[r['bytes']]:>18.2f} "
                         f"{r['graph_us'] / ref[r['bytes']]:>7.3f}")
    return "\n".join(lines)


def run(args) -> int:
    nproc = args.nproc or torch.cuda.device_count()
    if nproc < 2:
        raise SystemExit(f"perf.comms allreduce: needs >= 2 GPUs, found {nproc}")
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    bad = [a for a in algos if a not in OURS + SYMM + PEERS]
    if bad:
        raise SystemExit(f"--algos: unknown {bad}; expected a subset of {OURS + SYMM + PEERS}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat {args.repeat}: expected >= 1")
    tmp = tempfile.mkdtemp()
    cfg = {"dtype": args.dtype, "min_bytes": _parse_bytes(args.min_bytes), "max_bytes": _parse_bytes(args.max_bytes),
           "algos": algos, "no_eager": args.no_eager, "result_file": os.path.join(tmp, "result.json"),
           "blocks": parse_blocks(args.blocks), "repeat": args.repeat}
    ctx = mp.start_processes(_worker, args=(nproc, os.path.join(tmp, "rdzv"), json.dumps(cfg)), nprocs=nproc,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + args.timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise SystemExit(f"perf.comms allreduce: not done within --timeout-s {args.timeout_s}")
    with open(cfg["result_file"]) as f:
        res = json.load(f)
    print(_fmt_table(res))
    print(_fmt_graph_pivot(res))
    vs = _fmt_vs(res)
    if vs:
        print(vs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
