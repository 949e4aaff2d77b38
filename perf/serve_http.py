"""Serving figures of `nvl72 serve` over HTTP on one GPU, beside the decode bound (run on the GPU host).

    python -m perf.serve_http --json perf/out/serve_http.json

Starts `nvl72 serve` on a Qwen3-30B-A3B-shaped dummy-weight model (`--layers` of its 48 decoder
layers; the bound is for the same count) in a child process, drives it with `nvl72 bench`'s client
(streaming /v1/completions, token counts from usage) and reports
  - decode output tokens/s at concurrency 1 and 64 (per-sequence rate from the median TPOT, times
    the concurrency), beside the bound: the bytes one decode step must move (perf.serve's
    decode_step_bytes: Gated DeltaNet layers and their states too, experts at one byte per weight as
    FP8 stores them) / HBM copy bandwidth measured in this process before the server starts;
  - TTFT of 1K and 8K prompts on an idle server;
  - the agentic workload (long first turn, +`--turn-len` tokens per turn): prefix-cache hit rate
    and TTFT by turn.
Prints tables last; `--json` keeps everything. `--device cpu --model-config tiny.json` runs the same
path on a CPU (the test suite does).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import tempfile

from moe.layer import shared_slots
from nvl72.commands.bench import Bench, BenchConfig, table, turn_table
from nvl72.commands.bench_plots import plot_dir_problem, write_plots
from nvl72.config import ModelConfig
from perf.procs import Children, wait_serving
from perf.serve import QWEN3_30B_A3B, decode_step_bytes

SERVED_NAME = "qwen3-30b-a3b-dummy"


def server_command(model_dir: str, args) -> list[str]:
    cmd = [sys.executable, "-m", "nvl72", "serve", "--model", model_dir, "--load-format", "dummy",
           "--served-model-name", SERVED_NAME, "--port", str(args.port), "--device", args.device,
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.no_async_scheduling:
        cmd += ["--no-async-scheduling"]
    if args.device == "cpu":
        cmd += ["--dtype", "float32"]
    return cmd


async def drive(url: str, args) -> dict:
    bench = Bench(BenchConfig(url, SERVED_NAME, request_timeout=args.request_timeout))
    try:
        await bench.fixed(1, 2, args.decode_prompt_len, 8)  # warm-up: first kernels, graph pools
        decode = {c: await bench.fixed(c, c * args.decode_rounds, args.decode_prompt_len, args.decode_out)
                  for c in (1, args.max_num_seqs)}
        ttft = {n: await bench.fixed(1, args.ttft_requests, n, 1) for n in args.ttft_lens}
        agentic = await bench.agentic(args.conversations, args.turns, args.first_turn_len, args.turn_len,
                                      args.turn_output_len)
    finally:
        await bench.close()
    return {"decode": decode, "ttft": ttft, "agentic": agentic}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48,
                    help="decoder layers of the 48 (the bound uses the same count; fewer load faster, and their "
                         "ratio flatters: lm_head streams at its bound)")
    ap.add_argument("--model-config", default=None, help="a config.json to serve instead of the 30B-A3B shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="also the high decode concurrency")
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the server's chunk size (default: its own)")
    ap.add_argument("--no-async-scheduling", action="store_true", help="serve with the engine's synchronous loop")
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--decode-out", type=int, default=128)
    ap.add_argument("--decode-rounds", type=int, default=2, help="requests per concurrency slot")
    ap.add_argument("--ttft-lens", default="1024,8192")
    ap.add_argument("--ttft-requests", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--first-turn-len", type=int, default=8192)
    ap.add_argument("--turn-len", type=int, default=800)
    ap.add_argument("--turn-output-len", type=int, default=64)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, metavar="DIR", help="also draw the decode and agentic runs as SVG charts")
    ap.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    args = ap.parse_args(argv)
    args.ttft_lens = [int(x) for x in args.ttft_lens.split(",")]
    problem = args.plot and plot_dir_problem(args.plot)
    if problem:
        ap.error(problem)

    if args.model_config:
        with open(args.model_config) as f:
            cfg_dict = json.load(f)
    else:
        cfg_dict = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    cfg = ModelConfig.from_dict(cfg_dict)
    bw = None
    if args.device != "cpu":
        from nvl72.cuda_timing import hbm_copy_bandwidth

        bw = hbm_copy_bandwidth()  # before the server takes the GPU's memory
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg_dict, f)
        log = pathlib.Path(args.log or os.path.join(d, "server.log"))
        with Children() as kids:
            proc = kids.start(server_command(d, args), log)
            ready_s = wait_serving(url, [proc], [log], args.startup_timeout)
            try:
                res = asyncio.run(drive(url, args))
            except BaseException:
                sys.stderr.write("server log tail:\n" + log.read_text()[-4000:])
                raise

    rows = []
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size  # FP8: one byte per weight
    # the server (one rank, this environment) holds the shared expert as experts where moe.MoE can
    fused = bool(cfg.shared_expert_intermediate_size
                 and shared_slots(cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size)[0])
    for c, r in res["decode"].items():
        tpot = r.tpot_ms["median"]
        row = {"what": f"decode c={c}", "tpot_ms": tpot, "tok_s": c * 1e3 / tpot if tpot else None,
               "output_tok_s_wall": r.output_tok_s}
        if bw:
            b = decode_step_bytes(cfg_dict, c, args.decode_prompt_len + args.decode_out // 2, expert_bytes,
                                  shared_as_experts=fused)
            row.update(bound_step_ms=b["total"] / bw * 1e3, bound_tok_s=c * bw / b["total"])
        rows.append(row)
    for n, r in res["ttft"].items():
        rows.append({"what": f"TTFT {n}", "ttft_ms": r.ttft_ms["median"]})
    ag = res["agentic"]
    out = {"device": args.device, "layers": cfg.num_hidden_layers, "hbm_copy_GBps": bw / 1e9 if bw else None,
           "server_ready_s": ready_s, "rows": rows,
           "runs": {"decode": {c: vars(r) for c, r in res["decode"].items()},
                    "ttft": {n: vars(r) for n, r in res["ttft"].items()}, "agentic": vars(ag)}}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        print("charts: " + ", ".join(write_plots(list(res["decode"].values()) + [ag], args.plot)))
    print(table(list(res["decode"].values()) + list(res["ttft"].values()) + [ag]))
    print("\nagentic by turn (turn 2+ hit rate from the prefix cache; TTFT should follow 'new tok'):")
    print(turn_table(ag.per_turn))
    print(f"\nSERVE_HTTP {args.device}: {cfg.model_type}, {cfg.num_hidden_layers} layers, server ready in {ready_s:.0f} s"
          + (f", HBM copy {bw / 1e9:.0f} GB/s" if bw else ""))
    print(f"{'what':<14} {'TPOT ms':>8} {'tok/s':>9} {'bound ms':>9} {'% of bound':>10} {'TTFT ms':>8}")
    for r in rows:
        if "tpot_ms" in r:
            pct = f"{100 * r['bound_step_ms'] / r['tpot_ms']:.1f}%" if bw and r["tpot_ms"] else "-"
            bms = f"{r['bound_step_ms']:.3f}" if bw else "-"
            print(f"{r['what']:<14} {r['tpot_ms']:>8.3f} {r['tok_s']:>9.1f} {bms:>9} {pct:>10} {'':>8}")
        else:
            print(f"{r['what']:<14} {'':>8} {'':>9} {'':>9} {'':>10} {r['ttft_ms']:>8.1f}")
    hits = [t["cached_fraction"] for t in ag.per_turn[1:]]
    if hits:
        print(f"agentic: prefix hit rate {ag.prefix_cache_hit_rate}, turn-2+ cached fraction min {min(hits):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
