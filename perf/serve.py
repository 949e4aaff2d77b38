"""Serving figures of one GPU engine beside its memory-bandwidth bound (run on the GPU host).

    python -m perf.serve --json perf/out/serve.json

Builds a Qwen3-30B-A3B-shaped model with dummy weights (`--layers` of its 48 decoder layers, all by
default: FP8 experts, ~33 GB, loaded and captured in seconds; the bound below is for the same layer
count), drives the engine
directly (no HTTP: `nvl72 bench` is the client for a running server) and reports
  - decode output tokens/s at batch 1 and 64 (`--batches`; ignore_eos, greedy): the chosen attention
    backend (`--attention`) with CUDA graphs and eager, and FlashInfer's decode wrapper eager where it
    imports (`--modes`); async
    scheduling on (the next step prepared while one runs) unless `--no-async`;
  - TTFT of one 1K and one 8K prompt on an idle engine (one prefill forward + first sample);
  - the decode floor: bytes one decode step must read (active weights: attention, router, the
    experts the batch touches in expectation under uniform routing, lm_head, plus KV) divided by
    the HBM copy bandwidth measured in the same run.
Prints a table last; `--json` keeps everything.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import statistics
import time

import torch

from nvl72.config import ModelConfig
from nvl72.cuda_timing import hbm_copy_bandwidth
from nvl72.engine.core import freeze_heap
from nvl72.engine.engine import EngineConfig, LLMEngine
from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.model import attn_backends
from nvl72.model.loader import load_model, prepare_experts

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    intermediate_size=6144, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=40960, tie_word_embeddings=False, eos_token_id=[151645],
)


def decode_step_bytes(cfg: dict, batch: int, context: int, expert_bytes: float, act_bytes: int = 2,
                      shared_as_experts: bool = False) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences at `context` tokens must move in HBM, for a config.json
    dict: the dense weights `nvl72.plan.ModelSpec` counts (attention or Gated DeltaNet projections, router,
    shared expert, lm_head) at `act_bytes`, the experts the batch touches in expectation under uniform
    routing (`expert_bytes` each), the KV of every sequence and its GDN states (read and written).
    `shared_as_experts`: the shared expert is held in the experts' format (moe.MoE's `num_shared`), its
    weights at their bytes per weight."""
    from nvl72.plan import ModelSpec

    m = ModelSpec.from_config(cfg, "bound")
    touched = m.num_experts * (1 - (1 - m.num_experts_per_tok / m.num_experts) ** batch)
    total = (m.dense_params * act_bytes + m.num_hidden_layers * touched * expert_bytes
             + batch * context * m.kv_bytes_per_token + 2 * batch * m.state_bytes_per_seq)
    if shared_as_experts:
        shared = m.num_hidden_layers * 3 * m.hidden_size * m.shared_expert_intermediate_size
        total += shared * (expert_bytes / (3 * m.hidden_size * m.moe_intermediate_size) - act_bytes)
    return {"total": total, "experts_touched": touched}


def model_expert_bytes(model) -> float:
    """Stored bytes of one expert (w13 + w2 and their scales) in the backend's own format."""
    w = model.model.layers[0].mlp._weights
    return (w.w13.numel() * w.w13.element_size() + w.w2.numel() * w.w2.element_size()
            + sum(t.numel() * t.element_size() for t in (w.w13_scale, w.w2_scale) if t is not None)
            ) / w.w13.shape[0]


def shared_as_experts(model) -> bool:
    """Whether the model's MoE layers hold their shared expert as experts (moe.MoE.prepare decided)."""
    return any(getattr(layer.mlp, "num_shared", 0) for layer in model.model.layers)


def _drain(engine: LLMEngine, on_token=None) -> None:
    while engine.has_unfinished():
        outs = engine.step()
        if on_token is not None:
            on_token(outs)


def decode_rate(engine: LLMEngine, batch: int, prompt_len: int, out_len: int, seed: int) -> dict[str, float]:
    """Output tokens/s of `batch` sequences decoding together, counted after every first token."""
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(1000, 30000, (prompt_len,), generator=g).tolist()
        engine.add_request(AddRequest(f"d{seed}-{i}", prompt, sp))
    started: set[str] = set()
    mark = {}

    def on_token(outs):
        for o in outs:
            if o.new_token_ids:
                started.add(o.request_id)
        if "t0" not in mark and len(started) == batch:
            torch.cuda.synchronize()
            mark["t0"], mark["steps0"] = time.perf_counter(), engine.counters["num_steps"]
            mark["wait0"] = engine.counters["device_wait_seconds"]

    _drain(engine, on_token)
    torch.cuda.synchronize()
    dt = time.perf_counter() - mark["t0"]
    steps = engine.counters["num_steps"] - mark["steps0"]
    tokens = batch * (out_len - 1)
    wait = engine.counters["device_wait_seconds"] - mark["wait0"]
    return {"tok_s": tokens / dt, "step_ms": dt / max(steps, 1) * 1e3, "steps": steps,
            "wait_ms": wait / max(steps, 1) * 1e3}


def fixed_rate(engine: LLMEngine, concurrency: int, num_requests: int, prompt_len: int, out_len: int,
               seed: int) -> dict[str, float]:
    """The HTTP benchmark's fixed workload without HTTP: `num_requests` requests, at most
    `concurrency` in the engine, a new one admitted as one finishes (so prefills of the newcomers
    share steps with the others' decodes). Output tokens/s, steps and the mean step: beside the
    served TPOT, it says whether the engine or the server path sets it."""
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(1000, 30000, (prompt_len,), generator=g).tolist() for _ in range(num_requests)]
    nxt, live, tokens = 0, 0, 0
    steps0 = engine.counters["num_steps"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while nxt < num_requests or engine.has_unfinished():
        while live < concurrency and nxt < num_requests:
            engine.add_request(AddRequest(f"f{seed}-{nxt}", prompts[nxt], sp))
            nxt, live = nxt + 1, live + 1
        for o in engine.step():
            tokens += len(o.new_token_ids)
            live -= o.finish_reason is not None
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    steps = engine.counters["num_steps"] - steps0
    return {"tok_s": tokens / dt, "steps": steps, "step_ms": dt / max(steps, 1) * 1e3}


def ttft(engine: LLMEngine, prompt_len: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    engine.add_request(AddRequest(f"t{seed}", torch.randint(1000, 30000, (prompt_len,), generator=g).tolist(),
                                  SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _drain(engine)
    return time.perf_counter() - t0


def exposed_by_name(spans: list[tuple[str, float, float]]) -> dict[str, tuple[float, int]]:
    """{name: (exposed time, count)} of GPU spans (name, start, end) on one stream: each span's end
    minus the later of its start and the previous end. Under PDL a kernel starts before the previous
    one ends (its own span includes its wait), so its GPU time overstates what it adds to the step;
    this is what it adds to the critical path. Idle gaps (a start after the previous end) count
    for nobody."""
    out: dict[str, tuple[float, int]] = {}
    for name, exposed, _span, _lead in _critical_path(spans):
        total, n = out.get(name, (0.0, 0))
        out[name] = (total + exposed, n + 1)
    return out


def _critical_path(spans: list[tuple[str, float, float]]) -> list[tuple[str, float, float, float]]:
    """The spans in start order as (name, exposed, own span, lead): exposed = its end minus the later
    of its start and the previous ends (0 when it ends before them), lead = how long before the
    previous ends it started."""
    ops, prev_end = [], float("-inf")
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        ops.append((name, max(end - max(prev_end, start), 0.0), end - start, max(prev_end - start, 0.0)))
        prev_end = max(prev_end, end)
    return ops


# a decoder layer's first op in the LAYER table: Triton's attention, or nvl72.kernels.sm90_attn's at batch 1
ATTENTION_KERNELS = ("_paged_attention_kernel", "sm90_attnAttnOneToken")


def exposed_by_position(spans: list[tuple[str, float, float]], first: tuple[str, ...]) -> list[dict]:
    """One repeating unit of GPU ops (a decoder layer), position by position: the ops from each one
    whose name contains one of `first` up to the next; units of the commonest length only (the step's other
    ops, lm_head and sampling, fall in units of other lengths). Per position the medians over units
    of: exposed time (as `exposed_by_name`), the op's own span, and its lead (how long before the
    previous op's end it started: under PDL its early loads and its wait). Tells apart ops of one
    kernel (the q/k/v and o_proj GEMVs) that `exposed_by_name` sums together."""
    ops = _critical_path(spans)
    cuts = [i for i, op in enumerate(ops) if any(f in op[0] for f in first)]
    units = [ops[a:b] for a, b in zip(cuts, cuts[1:])]
    if not units:
        return []
    n = statistics.mode(len(u) for u in units)
    units = [u for u in units if len(u) == n]
    return [{"name": units[0][j][0], "exposed": statistics.median(u[j][1] for u in units),
             "span": statistics.median(u[j][2] for u in units), "lead": statistics.median(u[j][3] for u in units),
             "units": len(units)} for j in range(n)]


def profile_decode(engine: LLMEngine, batch: int, out_dir: str, steps: int = 24) -> None:
    """Where a decode step's time goes: GPU kernel time by kernel beside the step's wall time.

    GPU busy time well under the wall time means the host (scheduling, input preparation, sampling
    readback) is the limit, not the kernels. Then the kernels by exposed time (`exposed_by_name`):
    under PDL, what each adds to the step."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    decode_rate(engine, batch, 128, 8, seed=1000 + batch)  # warm
    g = torch.Generator().manual_seed(batch)
    sp = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(AddRequest(f"p{batch}-{i}", torch.randint(1000, 30000, (128,), generator=g).tolist(), sp))
    for _ in range(4):  # prefill + first decode steps outside the window
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    _drain(engine)
    prof.export_chrome_trace(os.path.join(out_dir, f"decode_b{batch}.json"))
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0)]
    busy = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3 / steps
    launches = sum(e.count for e in events if e.device_type.name == "CUDA") / steps
    print(f"\nPROFILE decode b={batch}: wall {wall / steps * 1e3:.3f} ms/step, GPU kernel time {busy:.3f} ms/step, "
          f"{launches:.0f} GPU ops (kernels, copies) per step")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    exposed = sorted(exposed_by_name(spans).items(), key=lambda kv: -kv[1][0])
    print(f"\nEXPOSED decode b={batch} (each GPU op's end minus the previous op's end, us per step; "
          f"{sum(t for _, (t, _n) in exposed) / steps:.1f} us in all)")
    for name, (t, n) in exposed[:20]:
        print(f"{t / steps:>9.1f} {n / steps:>6.1f}x  {name[:90]}")
    layer = exposed_by_position(spans, ATTENTION_KERNELS)
    if layer:
        print(f"\nLAYER decode b={batch} (one decoder layer's ops from the attention on, medians over {layer[0]['units']} "
              f"layers; us: exposed, own span, lead = started before the previous op's end)")
        for op in layer:
            print(f"{op['exposed']:>9.2f} {op['span']:>7.2f} {op['lead']:>7.2f}  {op['name'][:80]}")
        print(f"{sum(op['exposed'] for op in layer):>9.2f}  a layer")


def profile_prefill(engine: LLMEngine, prompt_len: int, out_dir: str) -> None:
    """Where one prompt's prefill goes (TTFT on an idle engine): GPU kernel time by kernel beside the
    wall time of the steps that prefill it (chunked by max_num_batched_tokens)."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    ttft(engine, prompt_len, seed=prompt_len + 7)  # warm
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = ttft(engine, prompt_len, seed=prompt_len + 8)
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(out_dir, f"prefill_{prompt_len}.json"))
    busy = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 1e3
    print(f"\nPROFILE prefill {prompt_len} tokens: wall {wall * 1e3:.3f} ms, GPU kernel time {busy:.3f} ms")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    # the host side: below ~2K tokens a prefill step waits on Python between launches, not on the GPU
    host = cProfile.Profile()
    host.enable()
    wall = ttft(engine, prompt_len, seed=prompt_len + 9)
    host.disable()
    print(f"\nHOST prefill {prompt_len} tokens (cProfile, wall {wall * 1e3:.3f} ms): functions by own time")
    pstats.Stats(host).sort_stats("tottime").print_stats(30)
    pstats.Stats(host).sort_stats("cumulative").print_stats(40)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default=None, metavar="JSON",
                    help="a config.json to measure instead of the Qwen3-30B-A3B shape (dummy weights)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers to build (default: the config's; the bound uses the same count; fewer load "
                         "faster, and their ratio flatters: lm_head streams at its bound)")
    ap.add_argument("--attention", default="auto",
                    help="attention backend for the graphs / eager runs and the TTFT rows (auto: the engine's choice)")
    ap.add_argument("--graph-batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--decode-out", type=int, default=64, help="output tokens per decode request")
    ap.add_argument("--modes", default="graphs,eager,flashinfer",
                    help="decode modes to time: graphs (the backend + CUDA graphs), eager, flashinfer (its decode wrapper)")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes to measure (and profile)")
    ap.add_argument("--reps", type=int, default=5, help="decode runs per batch size; the median is reported")
    ap.add_argument("--no-async", action="store_true",
                    help="synchronous scheduling (each step scheduled after the previous one's read-back)")
    ap.add_argument("--no-ttft", action="store_true", help="skip the 1K/8K TTFT rows (and their warm-up)")
    ap.add_argument("--fixed", type=int, default=0, metavar="C",
                    help="also run the HTTP benchmark's fixed workload engine-direct at concurrency C "
                         "(2 requests per slot, 256 prompt + 256 output tokens)")
    ap.add_argument("--server-config", action="store_true",
                    help="the engine as `nvl72 serve` builds it: prefix caching on, 2048 batched tokens, "
                         "max_model_len 16384, KV cache from free memory")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also profile decode at the --batches sizes (graphs) and one 1K / 8K prefill: kernel tables "
                         "(decode: also by exposed time) printed, traces in DIR")
    args = ap.parse_args(argv)
    want = set(args.modes.split(","))
    if not want or want - {"graphs", "eager", "flashinfer"}:
        ap.error(f"--modes={args.modes!r}: a comma-separated subset of graphs, eager, flashinfer")
    if args.reps < 1:
        ap.error(f"--reps={args.reps}: at least 1")
    try:
        batches = tuple(int(x) for x in args.batches.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1 or max(batches) > 64:
        ap.error(f"--batches={args.batches!r}: comma-separated batch sizes from 1 to 64 (the engine's max_num_seqs)")
    torch.manual_seed(0)
    bw = hbm_copy_bandwidth()
    if args.model_config:
        with open(args.model_config) as f:
            base, shape = json.load(f), os.path.basename(args.model_config)
    else:
        base, shape = QWEN3_30B_A3B, "Qwen3-30B-A3B shape"
    full_layers = base["num_hidden_layers"]
    cfg_dict = dict(base, num_hidden_layers=args.layers or full_layers)
    cfg = ModelConfig.from_dict(cfg_dict)
    t = time.perf_counter()
    model = load_model(None, config=cfg, dtype=torch.bfloat16, device="cuda", load_format="dummy")
    prepare_experts(model)  # as build_engine does: FP8 experts made, the bf16 ones freed
    load_s = time.perf_counter() - t
    sizes = tuple(int(x) for x in args.graph_batch_sizes.split(","))
    ecfg = EngineConfig(max_model_len=8192 + 256, max_num_seqs=64, max_num_batched_tokens=8192, page_size=16,
                        kv_cache_bytes=8 << 30, enable_prefix_caching=False, attention_backend=args.attention,
                        cuda_graph_batch_sizes=sizes, async_scheduling=not args.no_async)
    if args.server_config:
        ecfg = dataclasses.replace(ecfg, max_model_len=16384, max_num_batched_tokens=2048, kv_cache_bytes=None,
                                   enable_prefix_caching=True)
    t = time.perf_counter()
    engine = LLMEngine(model, ecfg, eos_token_ids=[])
    if args.server_config:
        engine.warmup()  # as build_engine does for `nvl72 serve`
        freeze_heap()
    capture_s = time.perf_counter() - t
    graphs = engine.runner.graphs
    moe_backend = model.model.layers[0].mlp._ready().name
    res: dict = {"gpu": torch.cuda.get_device_name(), "model": shape, "layers": cfg_dict["num_hidden_layers"], "hbm_copy_GBps": bw / 1e9,
                 "attention": engine.model.attn_backend.name, "moe_backend": moe_backend,
                 "graphs": graphs is not None, "async_scheduling": engine.overlap, "load_s": load_s, "engine_init_s": capture_s, "rows": []}
    pieces = engine.runner.prefill_graphs
    if pieces is not None:
        res["prefill_graphs"] = {"sizes": pieces.sizes, "capture_s": pieces.capture_seconds,
                                 "reserved_MiB": pieces.reserved_bytes / 2**20}
    decode_rate(engine, 4, 64, 8, seed=99)  # warm-up: kernels compiled / autotuned for these shapes
    ttft_lens = () if args.no_ttft else (1024, 8192)
    for n in ttft_lens:
        ttft(engine, n, seed=n + 1)  # warm-up of the prefill shapes
    chosen = engine.model.attn_backend

    def use(backend, g) -> None:
        """Decode through `backend` with the decode graphs `g`; without them every step eager (the prefill
        pieces too: they hold the backend they were captured with)."""
        engine.model.attn_backend, engine.runner.graphs = backend, g
        engine.runner.prefill_graphs = pieces if g is not None else None

    modes = [(f"{chosen.name}+graphs", chosen, graphs)] if graphs is not None and "graphs" in want else []
    if "eager" in want:
        modes.append((chosen.name, chosen, None))
    if "flashinfer" in want and attn_backends.available("flashinfer", model.device) is None:
        fi = attn_backends.FlashInferBackend(attn_backends.AttentionShape.of(model), model.device, decode=True)
        use(fi, None)
        decode_rate(engine, 4, 64, 8, seed=98)  # warm-up of the FlashInfer decode module
        modes.append(("flashinfer", fi, None))
    for mode, backend, g in modes:
        use(backend, g)
        for b in batches:
            # the median of --reps runs: one run of a few dozen steps moves by 10-20% with a host hiccup
            runs = sorted((decode_rate(engine, b, 128, args.decode_out, seed=b + 1000 * i) for i in range(args.reps)),
                          key=lambda r: r["step_ms"])
            r = runs[len(runs) // 2]
            bound = decode_step_bytes(cfg_dict, b, 128 + args.decode_out // 2, model_expert_bytes(model),
                                      model.dtype.itemsize, shared_as_experts(model))
            floor_step = bound["total"] / bw
            res["rows"].append({"what": f"decode b={b}", "mode": mode, "tok_s": r["tok_s"], "step_ms": r["step_ms"],
                                "step_ms_runs": [x["step_ms"] for x in runs], "wait_ms": r["wait_ms"],
                                "bound_step_ms": floor_step * 1e3, "bound_tok_s": b / floor_step,
                                "experts_touched": bound["experts_touched"]})
    engine.model.attn_backend, engine.runner.graphs, engine.runner.prefill_graphs = chosen, graphs, pieces
    if args.fixed:  # twice: the first run also pays for first-time kernel compilations of new shapes
        for i, seed in enumerate((7, 8)):
            r = fixed_rate(engine, args.fixed, 2 * args.fixed, 256, 256, seed=seed)
            res["rows"].append({"what": f"fixed c={args.fixed} #{i + 1}", "mode": chosen.name + ("+graphs" if graphs else ""),
                                "tok_s": r["tok_s"], "step_ms": r["step_ms"], "steps": r["steps"]})
    if args.profile:
        for b in batches:
            profile_decode(engine, b, args.profile)
        for n in ttft_lens:
            profile_prefill(engine, n, args.profile)
    for n in ttft_lens:
        s = ttft(engine, n, seed=n)
        res["rows"].append({"what": f"TTFT {n // 1024}K", "mode": chosen.name, "ms": s * 1e3})
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\nSERVE {res['gpu']}: {shape}, {cfg_dict['num_hidden_layers']}/{full_layers} layers, {model.dtype}, attention {res['attention']}, "
          f"MoE {moe_backend}, HBM copy {bw / 1e9:.0f} GB/s, graphs {'on' if graphs else 'off'}, "
          f"async scheduling {'on' if engine.overlap else 'off'}")
    pg = res.get("prefill_graphs")
    print("prefill graphs: " + (f"{len(pg['sizes'])} sizes to {pg['sizes'][-1]} tokens, captured in {pg['capture_s']:.1f} s, "
                                f"{pg['reserved_MiB']:.0f} MiB reserved" if pg else "off"))
    print(f"{'what':<14} {'mode':<14} {'tok/s':>9} {'step ms':>8} {'bound ms':>9} {'% of bound':>10} {'TTFT ms':>8}")
    for r in res["rows"]:
        if "bound_step_ms" in r:
            runs = r.get("step_ms_runs", [])
            spread = f"  (median of {len(runs)}: {runs[0]:.3f}-{runs[-1]:.3f} ms)" if len(runs) > 1 else ""
            spread += f"  host waits on the device {r['wait_ms']:.3f} ms a step"
            print(f"{r['what']:<14} {r['mode']:<14} {r['tok_s']:>9.1f} {r['step_ms']:>8.3f} {r['bound_step_ms']:>9.3f} "
                  f"{100 * r['bound_step_ms'] / r['step_ms']:>9.1f}% {'':>8}{spread}")
        elif "tok_s" in r:  # the fixed workload: prefills mixed in, no bound
            print(f"{r['what']:<14} {r['mode']:<14} {r['tok_s']:>9.1f} {r['step_ms']:>8.3f} {'':>9} {'':>10} {'':>8}")
        else:
            print(f"{r['what']:<14} {r['mode']:<14} {'':>9} {'':>8} {'':>9} {'':>10} {r['ms']:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
