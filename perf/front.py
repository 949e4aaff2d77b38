"""Per-token CPU cost and throughput of the HTTP front alone, on a CPU (no model, no GPU).

    python -m perf.front [--concurrency 1,16,64,256] [--step-us 500] [--out-len 128] [--json ...]

The server is the real stack of `nvl72 serve --engine process` (FastAPI app, uvicorn, the
`ProcessEngineClient` with its ZeroMQ reader thread, per-request queues, incremental
detokenization with the Qwen vocabulary, SSE) in a child process; behind it, instead of the
engine, `perf.front_source` (a measurement harness speaking the engine process's protocol through
`nvl72.engine.core.serve_zmq`) emits one token for every running request every `--step-us`. The
client is `nvl72 bench`'s streaming /v1/completions client (usage counts checked).

Per concurrency c (c * --rounds requests of --out-len tokens each):
  tok/s     output tokens / wall time at the client (all three processes share this machine's cores)
  offered   c * 1e6 / step_us: what the source would emit if nothing fell behind
  TPOT      median per request (ms)
  front us/tok   CPU time of the server process (all its threads) per output token
  source us/tok  CPU time of the token source process (the engine's output path) per output token
  client us/tok  CPU time of this (client) process per output token
  front max tok/s  1e6 / front us/tok: the server process's ceiling when it has a core to itself
CPU times come from /proc in clock ticks (10 ms): use runs of a few seconds at least.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import tempfile
import time

SERVED_NAME = "front-bench"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all threads) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def child_pids(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def serve(args) -> int:
    """The server child: the real front over a ProcessEngineClient whose engine is the token source."""
    import logging

    from nvl72.commands.serve import load_tokenizer
    from nvl72.engine.client import ProcessEngineClient
    from nvl72.server.app import ServerConfig, build_app
    from nvl72.server.runner import serve_forever

    logging.basicConfig(level=logging.WARNING)
    tok = load_tokenizer(None)
    engine = ProcessEngineClient(dict(step_us=args.step_us, max_model_len=args.max_model_len,
                                      vocab_size=tok.vocab_size), engine_module="perf.front_source")
    app = build_app(engine, tok, ServerConfig(served_model_name=SERVED_NAME))
    serve_forever(app, "127.0.0.1", args.port, log_level="warning")
    return 0


async def drive(url: str, server_pid: int, args) -> list[dict]:
    from nvl72.commands.bench import Bench, BenchConfig

    source_pid = child_pids(server_pid)[0]
    bench = Bench(BenchConfig(url, SERVED_NAME, request_timeout=args.request_timeout))
    rows = []
    try:
        await bench.fixed(2, 4, args.prompt_len, 16)  # warm-up
        for c in args.concurrency:
            cpu0 = (cpu_seconds(server_pid), cpu_seconds(source_pid), time.process_time())
            r = await bench.fixed(c, c * args.rounds, args.prompt_len, args.out_len)
            cpu1 = (cpu_seconds(server_pid), cpu_seconds(source_pid), time.process_time())
            n = r.output_tokens
            if n != c * args.rounds * args.out_len:
                raise RuntimeError(f"concurrency {c}: {n} output tokens, expected {c * args.rounds * args.out_len}")
            us = [(b - a) * 1e6 / n for a, b in zip(cpu0, cpu1)]
            rows.append(dict(concurrency=c, tok_s=r.output_tok_s, offered_tok_s=c * 1e6 / args.step_us,
                             tpot_ms=r.tpot_ms["median"], front_us_per_tok=us[0], source_us_per_tok=us[1],
                             client_us_per_tok=us[2], front_max_tok_s=1e6 / us[0] if us[0] else None,
                             output_tokens=n, duration_s=r.duration_s))
    finally:
        await bench.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--step-us", type=float, default=500.0, help="token source step period (microseconds)")
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="requests per concurrency slot")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--startup-timeout", type=float, default=120)
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server child
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args)
    args.concurrency = [int(x) for x in args.concurrency.split(",")]

    from perf.procs import Children, wait_serving

    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "perf.front", "--serve", "--port", str(args.port), "--step-us", str(args.step_us),
           "--max-model-len", str(args.max_model_len)]
    with tempfile.TemporaryDirectory() as d, Children() as kids:
        log = pathlib.Path(d) / "server.log"
        proc = kids.start(cmd, log)
        wait_serving(url, [proc], [log], args.startup_timeout)
        try:
            rows = asyncio.run(drive(url, proc.pid, args))
        except BaseException:
            sys.stderr.write("server log tail:\n" + log.read_text()[-4000:])
            raise
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    print(f"HTTP front alone (token source every {args.step_us:g} us, {args.out_len} tokens/request, "
          f"{os.cpu_count()} CPUs shared by client, server and source)")
    print("| concurrency | tok/s | offered tok/s | TPOT ms | front us/tok | source us/tok | client us/tok "
          "| front max tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['tok_s']:.0f} | {r['offered_tok_s']:.0f} | {r['tpot_ms']:.3f} "
              f"| {r['front_us_per_tok']:.1f} | {r['source_us_per_tok']:.1f} | {r['client_us_per_tok']:.1f} "
              f"| {r['front_max_tok_s'] or 0:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
