"""Disaggregated prefill/decode over HTTP against one colocated engine (run on a host with 2 GPUs).

    python -m perf.disagg --layers 8 --json perf/out/disagg.json

Builds a config directory for a Qwen3-30B-A3B-shaped model (`--layers` of its 48 decoder layers,
dummy weights; `--shape tiny` for a CPU smoke run) and measures, in this order, in one run:
  1. peer bandwidth between the two devices: torch `copy_` of 64 MiB cuda:0 -> cuda:1, and
     send/recv over the process group the KV transport uses (NCCL on GPU, gloo on CPU);
  2. colocated: `nvl72 serve` on cuda:0; streamed TTFT and time to the second token per prompt
     length (a few requests each on an idle server, after one warm-up request per length);
  3. disaggregated: `python -m launch` with `--prefill-tp` + `--decode-size` ranks (torchrun-style
     RANK/WORLD_SIZE variables, spawned here: no mpiexec needed; one GPU a rank), one prefill
     instance (TP, on ranks 0.. beside the HTTP front) and one decode instance (one rank, or DP
     attention + EP over `--decode-size` ranks); the same requests; the KV transfer of each request
     (bytes, seconds, as the decode rank's transport measured it: CUDA events from posting its
     receives to the last arrival) read from the decode ranks' logs. `--kv-transport` goes to the launch (auto, p2p: staging rings in
     peer memory, sendrecv: NCCL/gloo); the transport the ranks chose is read from the log. With p2p
     parts may land in the ring before the decode rank posts its receiver: its "transfer" is the
     decode rank's wait from posting to the last scatter, not the link's time.
In the disaggregated run the first token streams from the prefill rank before the KV transfer; the
transfer shows in the time to the second token. Every request is greedy: each one's `--output-len`
streamed tokens are compared with the colocated engine's for the same prompt (`greedy_equal`: exact
in fp32, `--dtype float32`; bf16 sums in another order under TP/EP and may part ways after some
tokens). Prints a table last; `--json` keeps everything.
Every child runs in its own session with a timeout and is killed on exit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from nvl72.commands.bench import BenchError
from nvl72.parallel import free_port
from perf.procs import Children, wait_serving
from perf.serve import QWEN3_30B_A3B

SHAPES = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    # the same architecture at toy width, for a CPU run of this benchmark's code path
    "tiny": dict(QWEN3_30B_A3B, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64),
}
MODEL_NAME = "bench"
COPY_BYTES = 64 << 20
TRANSPORT_LINE = re.compile(r"rank \d+: KV transport (\w+)")
TRANSFER_LINE = re.compile(r"decode rank \d+: KV transfer of (\S+): (\d+) tokens, (\d+) bytes \(([^)]*)\) "
                           r"in ([\d.]+) ms")


def write_model(root: pathlib.Path, shape: str, layers: int) -> pathlib.Path:
    """A config-only model directory (dummy weights; the front uses the shipped Qwen vocabulary)."""
    if shape not in SHAPES:
        raise BenchError(f"--shape {shape!r} is not one of {sorted(SHAPES)}")
    if layers < 1:
        raise BenchError(f"--layers {layers} must be >= 1")
    d = root / f"{shape}-{layers}l"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(SHAPES[shape], num_hidden_layers=layers)))
    return d


# ---------------------------------------------------------------------------------------------
# 1. Peer bandwidth (two processes: rank 0 on device 0, rank 1 on device 1)
# ---------------------------------------------------------------------------------------------
def _peer_worker(rank: int, device: str, init_file: str, sizes: list[int], out_path: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60), **({"device_id": dev} if cuda else {}))
    res: dict = {"backend": dist.get_backend(), "send_recv": {},
                 "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}
    if cuda and rank == 0:  # what the KV transfer could reach: a plain peer copy over NVLink
        from nvl72.cuda_timing import time_cuda

        src = torch.randint(0, 255, (COPY_BYTES,), dtype=torch.uint8, device=dev)
        dst = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda:1")
        t = time_cuda(lambda: dst.copy_(src), iters=10)
        assert torch.equal(dst.cpu(), src.cpu()), "peer copy corrupted the data"
        res["peer_copy"] = {"bytes": COPY_BYTES, "us": t * 1e6, "GBps": COPY_BYTES / t / 1e9}
        del src, dst
    dist.barrier()
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        want = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g).to(dev)
        buf = want.clone() if rank == 0 else torch.empty_like(want)

        def op():
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)

        op()  # warm-up (NCCL builds the pair's communicator here), checked
        if rank == 1:
            assert torch.equal(buf, want), f"send/recv of {n} bytes corrupted the data"
        iters = 5
        if cuda:
            from perf.comms.timing import events_time, loop, max_over_ranks

            t = max_over_ranks(events_time(loop(op, iters))) / iters
        else:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                op()
            tt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            t = float(tt) / iters
        res["send_recv"][str(n)] = {"us": t * 1e6, "GBps": n / t / 1e9}
    if rank == 0:
        pathlib.Path(out_path).write_text(json.dumps(res))
    dist.destroy_process_group()


def peer_bandwidth(device: str, sizes: list[int], timeout: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peer.json")
        procs = [ctx.Process(target=_peer_worker, args=(r, device, os.path.join(tmp, "init"), sizes, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        codes = [p.exitcode for p in procs]
        if codes != [0, 0] or not os.path.exists(out):
            raise BenchError(f"peer bandwidth workers exited with {codes} (timeout {timeout:g} s)")
        return json.loads(pathlib.Path(out).read_text())


# ---------------------------------------------------------------------------------------------
# Servers and streamed requests
# ---------------------------------------------------------------------------------------------
def stream_times(client, prompt: list[int], max_tokens: int) -> tuple[float, float, list[str]]:
    """Seconds from sending to the first and to the second streamed token, and the streamed tokens
    (logprobs on: one chunk per token, also where a token's text is not complete yet)."""
    t0 = time.perf_counter()
    marks, tokens = [], []
    for c in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       logprobs=1, stream=True, extra_body={"ignore_eos": True}):
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens:
            marks.extend([time.perf_counter()] * len(c.choices[0].logprobs.tokens))
            tokens.extend(c.choices[0].logprobs.tokens)
    if len(marks) < 2:
        raise BenchError(f"a {len(prompt)}-token prompt streamed {len(marks)} tokens, expected {max_tokens}")
    return marks[0] - t0, marks[1] - t0, tokens


def run_requests(url: str, prompt_lens: list[int], requests: int, vocab: int, seed: int, timeout: float,
                 output_len: int) -> dict:
    """Per prompt length: one warm-up request (kernel compilation for the shape), then `requests`
    measured ones, one at a time; fresh random prompts (no prefix reuse; the same for the same seed)."""
    import openai
    import torch

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=timeout, max_retries=0)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in prompt_lens:
        prompts = [torch.randint(1000, min(vocab, 30000), (n,), generator=g).tolist() for _ in range(requests + 1)]
        stream_times(client, prompts[0], output_len)
        times = [stream_times(client, p, output_len) for p in prompts[1:]]
        out[n] = {"ttft_ms": [t[0] * 1e3 for t in times], "second_token_ms": [t[1] * 1e3 for t in times],
                  "tokens": [t[2] for t in times]}
    return out


def colocated(kids: Children, model: pathlib.Path, args, logdir: pathlib.Path) -> dict:
    port = free_port("127.0.0.1")
    log = logdir / "colocated.log"
    p = kids.start([sys.executable, "-m", "nvl72", "serve", "--model", str(model), "--load-format", "dummy",
                    "--device", "cuda:0" if args.device == "cuda" else "cpu", "--port", str(port),
                    "--served-model-name", MODEL_NAME, *_serve_flags(args)], log)
    url = f"http://127.0.0.1:{port}"
    wait_serving(url, [p], [log], args.start_timeout)
    res = run_requests(url, args.prompt_lens, args.requests, SHAPES[args.shape]["vocab_size"], 1, args.request_timeout,
                       args.output_len)
    kids.stop(20)
    return res


def _serve_flags(args) -> list[str]:
    """The engine settings both runs share, as `nvl72 serve` flags."""
    return ["--max-model-len", str(args.max_model_len), "--max-num-seqs", "8", "--max-num-batched-tokens",
            str(max(args.prompt_lens)), "--page-size", "16", "--kv-cache-memory", args.kv_cache, "--no-prefix-caching",
            "--seed", "0", "--dtype", args.dtype]


def _engine_args(model: pathlib.Path, args) -> dict:
    """The same settings as build_engine keywords (what `--engine-args` takes)."""
    from nvl72.commands.serve import parse_bytes

    kw = dict(model=str(model), load_format="dummy", device=args.device, max_model_len=args.max_model_len,
              max_num_seqs=8, max_num_batched_tokens=max(args.prompt_lens), page_size=16,
              kv_cache_bytes=parse_bytes("kv-cache", args.kv_cache), enable_prefix_caching=False, seed=0)
    return kw | {"dtype": args.dtype}


def disaggregated(kids: Children, model: pathlib.Path, args,
                  logdir: pathlib.Path) -> tuple[dict, list[dict], list, str | None]:
    from nvl72.commands.launch import request_shutdown

    port, ready = free_port("127.0.0.1"), logdir / "disagg-ready.json"
    ready.unlink(missing_ok=True)
    world = args.prefill_tp + args.decode_size
    cmd = [sys.executable, "-m", "launch", "--model", str(model), "--prefill-tp", str(args.prefill_tp),
           "--decode-size", str(args.decode_size),
           "--prefill-instances", "1", "--decode-instances", "1", "--device", args.device,
           "--timeout", str(args.start_timeout), "--ready-file", str(ready), "--ready-timeout", str(args.start_timeout),
           "--engine-args", json.dumps(_engine_args(model, args)), "--http-host", "127.0.0.1",
           "--http-port", str(port), "--served-model-name", MODEL_NAME, "--transfer-timeout", "60",
           "--kv-transport", args.kv_transport]
    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port("127.0.0.1"))}
    logs = [logdir / f"disagg-rank{r}.log" for r in range(world)]
    procs = [kids.start(cmd, logs[r], RANK=str(r), LOCAL_RANK=str(r), **env) for r in range(world)]
    url = f"http://127.0.0.1:{port}"
    wait_serving(url, procs, logs, args.start_timeout)
    res = run_requests(url, args.prompt_lens, args.requests, SHAPES[args.shape]["vocab_size"], 1, args.request_timeout,
                       args.output_len)
    request_shutdown(json.loads(ready.read_text())["front"], reason="perf.disagg done")
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    codes = kids.stop(10)
    decode_logs = [log.read_text() for log in logs[args.prefill_tp:]]
    transfers = [{"request": m[1], "tokens": int(m[2]), "bytes": int(m[3]),
                  "bytes_by_kind": {k: int(v) for k, v in (x.split() for x in m[4].split(", "))}, "ms": float(m[5])}
                 for text in decode_logs for m in TRANSFER_LINE.finditer(text)]
    if codes != [0] * world:
        print(f"WARNING: disaggregated ranks exited with {codes}; logs in {logdir}", flush=True)
    chosen = TRANSPORT_LINE.search(decode_logs[0])
    return res, transfers, codes, chosen and chosen.group(1)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def summarize(prompt_lens: list[int], requests: int, coloc: dict, disagg: dict, transfers: list[dict],
              peer: dict) -> list[dict]:
    """One row per prompt length: medians of the measured requests; the transfer time is the median
    over every transfer of the length (the warm-up one included: with several decode ranks their logs
    do not say which request came first); `greedy_equal`: measured requests whose streamed tokens
    equal the colocated engine's."""
    want = len(prompt_lens) * (requests + 1)
    if len(transfers) != want:
        raise BenchError(f"the decode ranks logged {len(transfers)} KV transfers, expected {want}")
    rows = []
    big = peer["send_recv"][str(max(int(k) for k in peer["send_recv"]))]["GBps"]
    for n in prompt_lens:
        mine = [t for t in transfers if t["tokens"] == n]
        if len(mine) != requests + 1:
            raise BenchError(f"{len(mine)} transfers carried {n} tokens, expected {requests + 1} "
                             f"(tokens per transfer: {[t['tokens'] for t in transfers]})")
        ms = statistics.median(t["ms"] for t in mine)
        rows.append({"prompt_len": n, "colocated_ttft_ms": statistics.median(coloc[n]["ttft_ms"]),
                     "disagg_ttft_ms": statistics.median(disagg[n]["ttft_ms"]),
                     "colocated_second_token_ms": statistics.median(coloc[n]["second_token_ms"]),
                     "disagg_second_token_ms": statistics.median(disagg[n]["second_token_ms"]),
                     "kv_bytes": mine[0]["bytes"], "bytes_by_kind": mine[0]["bytes_by_kind"], "transfer_ms": ms,
                     "transfer_GBps": mine[0]["bytes"] / ms / 1e6,
                     "peer_copy_GBps": peer.get("peer_copy", {}).get("GBps"), "send_recv_GBps": big,
                     "greedy_equal": sum(a == b for a, b in zip(coloc[n]["tokens"], disagg[n]["tokens"]))})
    return rows


def print_table(res: dict) -> None:
    def f(v, width: int, digits: int) -> str:
        return f"{v:>{width}.{digits}f}" if v is not None else f"{'-':>{width}}"

    print(f"\nDISAGG {res['device']}: Qwen3-30B-A3B shape ({res['shape']}), {res['layers']} layers, {res['dtype']}, "
          f"prefill TP{res['prefill_tp']} -> decode {res['decode_size']} rank(s), {res['requests']} requests per "
          f"length, {res['output_len']} tokens each, KV transport {res['kv_transport']} (process group: "
          f"{res['peer']['backend']})")
    print(f"{'prompt':>7} | {'coloc TTFT ms':>13} | {'disagg TTFT ms':>14} | {'coloc 2nd ms':>12} | "
          f"{'disagg 2nd ms':>13} | {'KV bytes':>11} | {'transfer ms':>11} | {'transfer GB/s':>13} | "
          f"{'peer-copy GB/s':>14} | {'send/recv GB/s':>14} | {'greedy ==':>9}")
    for r in res["rows"]:
        print(f"{r['prompt_len']:>7} | {r['colocated_ttft_ms']:>13.2f} | {r['disagg_ttft_ms']:>14.2f} | "
              f"{r['colocated_second_token_ms']:>12.2f} | {r['disagg_second_token_ms']:>13.2f} | {r['kv_bytes']:>11} | "
              f"{r['transfer_ms']:>11.3f} | {r['transfer_GBps']:>13.2f} | {f(r['peer_copy_GBps'], 14, 1)} | "
              f"{r['send_recv_GBps']:>14.2f} | {r['greedy_equal']:>4}/{res['requests']:<4}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", default="qwen3-30b-a3b", help=f"model shape, one of {sorted(SHAPES)}")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (of the shape's 48)")
    ap.add_argument("--prompt-lens", default="1024,4096,8192", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--requests", type=int, default=3, help="measured requests per prompt length")
    ap.add_argument("--kv-cache", default="8GiB", help="KV cache of each engine")
    ap.add_argument("--start-timeout", type=float, default=120.0, help="seconds for a server to serve")
    ap.add_argument("--request-timeout", type=float, default=60.0, help="seconds for one request")
    ap.add_argument("--peer-timeout", type=float, default=60.0, help="seconds for the peer bandwidth step")
    ap.add_argument("--out-dir", default=None, help="model directory and server logs (default: a temporary one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--kv-transport", choices=("auto", "p2p", "sendrecv"), default="sendrecv",
                    help="the disaggregated run's KV transport (launch's --kv-transport)")
    ap.add_argument("--prefill-tp", type=int, default=1, help="ranks of the prefill instance (TP)")
    ap.add_argument("--decode-size", type=int, default=1, help="ranks of the decode instance (> 1: DP attention + EP)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="both runs' dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--output-len", type=int, default=4, help="tokens each request generates (>= 2)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.prefill_tp < 1 or args.decode_size < 1 or args.output_len < 2:
        raise BenchError(f"--prefill-tp {args.prefill_tp}, --decode-size {args.decode_size}, --output-len "
                         f"{args.output_len}: need >= 1, >= 1, >= 2")
    try:
        args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    except ValueError:
        raise BenchError(f"--prompt-lens {args.prompt_lens!r} is not a comma-separated list of integers") from None
    if args.requests < 1 or min(args.prompt_lens) < 2:
        raise BenchError(f"--requests {args.requests} and --prompt-lens {args.prompt_lens}: need >= 1 and >= 2")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < max(2, args.prefill_tp + args.decode_size):
            raise BenchError(f"--prefill-tp {args.prefill_tp} + --decode-size {args.decode_size} need as many GPUs "
                             f"(and >= 2 for the peer bandwidth); {torch.cuda.device_count()} visible")
    args.max_model_len = max(args.prompt_lens) + 64
    # `timeout` sends SIGTERM: exit through the finally clauses, which stop the servers' sessions.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory() as tmp:
        logdir = pathlib.Path(args.out_dir or tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        model = write_model(logdir, args.shape, args.layers)
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        t0 = time.monotonic()
        peer = peer_bandwidth(args.device, [COPY_BYTES, 256 << 20 if args.device == "cuda" else 4 << 20],
                              args.peer_timeout)
        gpus = max(2, args.prefill_tp + args.decode_size)  # the peer step's two, or one a rank
        name = peer.pop("device")
        res = {"device": name if args.device == "cpu" else f"{gpus} x {name}", "shape": args.shape, "layers": args.layers, "requests": args.requests,
               "dtype": args.dtype, "prefill_tp": args.prefill_tp, "decode_size": args.decode_size,
               "output_len": args.output_len, "peer": peer}
        _stage(res, "peer", t0, args.json)
        with Children(env) as kids:
            t0 = time.monotonic()
            res["colocated"] = colocated(kids, model, args, logdir)
            _stage(res, "colocated", t0, args.json)
            t0 = time.monotonic()
            res["disaggregated"], res["transfers"], res["rank_exit_codes"], res["kv_transport"] = \
                disaggregated(kids, model, args, logdir)
            _stage(res, "disaggregated", t0, args.json)
        res["rows"] = summarize(args.prompt_lens, args.requests, res["colocated"], res["disaggregated"],
                                res["transfers"], res["peer"])
        _stage(res, "rows", t0, args.json)
    print_table(res)
    return 0


def _stage(res: dict, key: str, t0: float, path: str | None) -> None:
    """Log a finished stage and keep what is measured so far (a later stage may fail)."""
    print(f"{key} ({time.monotonic() - t0:.0f} s): {json.dumps(res[key])[:2000]}", flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
