"""`nvl72 bench`: serving benchmark against a running nvl72 (or any OpenAI-compatible) HTTP server.

Two workloads, both streamed through /v1/completions with token-id prompts (no tokenizer on the
client) and `ignore_eos`, so every request produces exactly the output length asked for:
  fixed     N requests of `input_len` random tokens -> `output_len` tokens, at each concurrency;
  agentic   several conversations run side by side; turn 1 is a long prompt, each later turn
            resends the whole history plus `turn_len` new tokens (tool output / user text), so
            the server's prefix cache can serve the history. The model's replies are not fed
            back (the client sees text, not token ids): the history is the prompts alone.

Figures per run: TTFT (request sent -> first streamed text), TPOT ((last - first) / (output
tokens - 1)), output tokens/s counted from the server's usage (tokens, not stream chunks),
request rate; from /metrics deltas over the run: prefix-cache hit rate (hit / queried prompt
tokens) and speculative (MTP) acceptance (accepted / drafted tokens). JSON out plus a table.
The client lives here (nvl72 may not import perf/); `perf/serve.py` runs it against a server it
starts on a GPU, beside the hardware bound.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from nvl72.cli import CLIError
from nvl72.commands.bench_plots import plot_dir_problem, write_plots

HELP = "benchmark a running server (fixed lengths and the agentic workload)"


class BenchError(RuntimeError):
    """The server answered something the benchmark cannot use (names the request and the reason)."""


# ------------------------------------------------------------------ workloads
def random_prompt(rng: random.Random, n: int, token_range: tuple[int, int]) -> list[int]:
    lo, hi = token_range
    return [rng.randrange(lo, hi) for _ in range(n)]


def fixed_workload(num_prompts: int, input_len: int, rng: random.Random,
                   token_range: tuple[int, int]) -> list[list[int]]:
    """`num_prompts` independent random prompts of `input_len` tokens."""
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"num_prompts={num_prompts} and input_len={input_len} must be >= 1")
    return [random_prompt(rng, input_len, token_range) for _ in range(num_prompts)]


def agentic_workload(num_conversations: int, num_turns: int, first_len: int, turn_len: int, rng: random.Random,
                     token_range: tuple[int, int]) -> list[list[list[int]]]:
    """Per conversation, the prompt of each turn: turn t = turn t-1's prompt + `turn_len` new tokens."""
    if min(num_conversations, num_turns, first_len) < 1 or turn_len < 0:
        raise ValueError(f"conversations={num_conversations}, turns={num_turns}, first_len={first_len}, "
                         f"turn_len={turn_len}: counts must be >= 1 (turn_len >= 0)")
    convs = []
    for _ in range(num_conversations):
        prompt = random_prompt(rng, first_len, token_range)
        turns = [prompt]
        for _ in range(num_turns - 1):
            prompt = prompt + random_prompt(rng, turn_len, token_range)
            turns.append(prompt)
        convs.append(turns)
    return convs


# ------------------------------------------------------------------ one request
@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int  # from the server's usage
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens (0 if absent)
    ttft: float  # seconds, send -> first text
    latency: float  # seconds, send -> end of stream
    chunks: int  # stream events with text (can be fewer than tokens)

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                            timeout: float) -> RequestResult:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=True,
                stream_options=dict(include_usage=True))
    t0 = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise BenchError(f"POST /v1/completions ({len(prompt)} prompt tokens) -> HTTP {r.status_code}: "
                             f"{(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise BenchError(f"stream error after {chunks} chunks: {ev['error']}")
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
    end = time.perf_counter()
    if usage is None:
        raise BenchError("the stream ended without a usage chunk (stream_options.include_usage unsupported?)")
    out = int(usage["completion_tokens"])
    if first is None:
        first = end
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    return RequestResult(int(usage["prompt_tokens"]), out, cached, first - t0, end - t0, chunks)


# ------------------------------------------------------------------ metrics
METRIC_KEYS = {
    "prefix_queries": "nvl72:prefix_cache_queries",
    "prefix_hits": "nvl72:prefix_cache_hits",
    "spec_drafted": "nvl72:spec_decode_num_draft_tokens",
    "spec_accepted": "nvl72:spec_decode_num_accepted_tokens",
    "engine_steps": "nvl72:num_steps",
    "engine_step_seconds": "nvl72:step_seconds",
    "engine_eager_steps": "nvl72:num_eager_steps",
    "engine_eager_step_seconds": "nvl72:eager_step_seconds",
    "engine_periods": "nvl72:num_step_periods",
    "engine_period_seconds": "nvl72:step_period_seconds",
    "engine_wait_seconds": "nvl72:device_wait_seconds",
    "engine_triton_compiles": "nvl72:triton_compiles",
}


def parse_metrics(text: str) -> dict[str, float]:
    """The counters of METRIC_KEYS from a Prometheus exposition (summed over labels; absent -> 0)."""
    want = {v: k for k, v in METRIC_KEYS.items()}
    out = dict.fromkeys(METRIC_KEYS, 0.0)
    for fam in text_string_to_metric_families(text):
        key = want.get(fam.name) or want.get(fam.name.removesuffix("_total"))
        if key is None:
            continue
        out[key] = sum(s.value for s in fam.samples if not s.name.endswith("_created"))
    return out


def metric_rates(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    d = {k: after[k] - before[k] for k in METRIC_KEYS}
    return {
        "prefix_cache_hit_rate": d["prefix_hits"] / d["prefix_queries"] if d["prefix_queries"] > 0 else None,
        "mtp_acceptance": d["spec_accepted"] / d["spec_drafted"] if d["spec_drafted"] > 0 else None,
        "engine_steps": d["engine_steps"] if d["engine_steps"] > 0 else None,
        "engine_step_ms": d["engine_step_seconds"] / d["engine_steps"] * 1e3 if d["engine_steps"] > 0 else None,
        "engine_eager_steps": d["engine_eager_steps"] if d["engine_steps"] > 0 else None,
        "engine_eager_step_ms": (d["engine_eager_step_seconds"] / d["engine_eager_steps"] * 1e3
                                 if d["engine_eager_steps"] > 0 else None),
        "engine_period_ms": d["engine_period_seconds"] / d["engine_periods"] * 1e3 if d["engine_periods"] > 0 else None,
        "engine_wait_ms": d["engine_wait_seconds"] / d["engine_steps"] * 1e3 if d["engine_steps"] > 0 else None,
        "engine_triton_compiles": d["engine_triton_compiles"] if d["engine_steps"] > 0 else None,
    }


# ------------------------------------------------------------------ summaries
def _stats(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    s = sorted(xs)
    return {"mean": statistics.fmean(s), "median": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))]}


@dataclass
class RunSummary:
    workload: str
    concurrency: int
    num_requests: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_tok_s: float
    request_per_s: float
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    usage_cached_fraction: float | None = None
    prefix_cache_hit_rate: float | None = None
    mtp_acceptance: float | None = None
    per_turn: list[dict] | None = None  # agentic: by turn index, over conversations
    # the engine over the run (from /metrics; None when the server does not export them): its steps and
    # their mean host time, to tell an engine-bound TPOT from one the front or the client adds to
    engine_steps: float | None = None
    engine_step_ms: float | None = None
    engine_eager_steps: float | None = None  # of engine_steps, those outside the CUDA graphs
    engine_eager_step_ms: float | None = None
    # the engine loop's mean period between steps with requests in flight (at concurrency 1 the TPOT's
    # engine side; above engine_step_ms by the time the serving loop spends outside the step)
    engine_period_ms: float | None = None
    engine_wait_ms: float | None = None  # of engine_step_ms, the host blocked on the device's tokens
    engine_triton_compiles: float | None = None  # Triton kernels compiled during the run (warm-up gaps)


def summarize(workload: str, concurrency: int, results: list[RequestResult], duration: float,
              rates: dict[str, float | None]) -> RunSummary:
    out = sum(r.output_tokens for r in results)
    inp = sum(r.prompt_tokens for r in results)
    ms = lambda xs: {k: (v * 1e3 if v is not None else None) for k, v in _stats(xs).items()}  # noqa: E731
    return RunSummary(
        workload, concurrency, len(results), duration, inp, out, out / duration if duration > 0 else 0.0,
        len(results) / duration if duration > 0 else 0.0,
        ms([r.ttft for r in results]), ms([r.tpot for r in results if r.tpot is not None]),
        sum(r.cached_tokens for r in results) / inp if inp else None,
        rates.get("prefix_cache_hit_rate"), rates.get("mtp_acceptance"),
        engine_steps=rates.get("engine_steps"), engine_step_ms=rates.get("engine_step_ms"),
        engine_eager_steps=rates.get("engine_eager_steps"), engine_eager_step_ms=rates.get("engine_eager_step_ms"),
        engine_period_ms=rates.get("engine_period_ms"), engine_wait_ms=rates.get("engine_wait_ms"),
        engine_triton_compiles=rates.get("engine_triton_compiles"))


def per_turn(per_conv: list[list[RequestResult]]) -> list[dict]:
    """Turn t across conversations: prompt tokens, the cached share of them and TTFT, so a reader sees
    whether turn-2+ TTFT follows the new tokens (prompt - cached) rather than the whole context."""
    rows = []
    for t in range(max(len(rs) for rs in per_conv)):
        rs = [c[t] for c in per_conv if len(c) > t]
        rows.append({"turn": t + 1, "prompt_tokens": statistics.fmean(r.prompt_tokens for r in rs),
                     "new_tokens": statistics.fmean(r.prompt_tokens - r.cached_tokens for r in rs),
                     "cached_fraction": sum(r.cached_tokens for r in rs) / sum(r.prompt_tokens for r in rs),
                     "ttft_ms": statistics.fmean(r.ttft for r in rs) * 1e3})
    return rows


def turn_table(rows: list[dict]) -> str:
    out = [f"{'turn':>4} {'prompt tok':>10} {'new tok':>8} {'cached':>7} {'TTFT ms':>8}"]
    out += [f"{r['turn']:>4} {r['prompt_tokens']:>10.0f} {r['new_tokens']:>8.0f} {r['cached_fraction']:>7.3f} "
            f"{r['ttft_ms']:>8.1f}" for r in rows]
    return "\n".join(out)


# ------------------------------------------------------------------ runs
@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    request_timeout: float = 600.0
    seed: int = 0
    token_range: tuple[int, int] = (1000, 30000)


class Bench:
    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        self.client = httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                        timeout=cfg.request_timeout)

    async def close(self) -> None:
        await self.client.aclose()

    async def model(self) -> str:
        if self.cfg.model is None:
            r = await self.client.get("/v1/models", timeout=30)
            r.raise_for_status()
            self.cfg.model = r.json()["data"][0]["id"]
        return self.cfg.model

    async def metrics(self) -> dict[str, float]:
        r = await self.client.get("/metrics", timeout=30)
        if r.status_code != 200:
            return dict.fromkeys(METRIC_KEYS, 0.0)
        return parse_metrics(r.text)

    async def _request(self, prompt: list[int], max_tokens: int) -> RequestResult:
        return await stream_completion(self.client, await self.model(), prompt, max_tokens, self.cfg.request_timeout)

    async def fixed(self, concurrency: int, num_prompts: int, input_len: int, output_len: int) -> RunSummary:
        """`num_prompts` requests, at most `concurrency` in flight."""
        rng = random.Random(self.cfg.seed * 1000 + concurrency)
        prompts = fixed_workload(num_prompts, input_len, rng, self.cfg.token_range)
        await self.model()
        sem = asyncio.Semaphore(concurrency)

        async def one(p):
            async with sem:
                return await self._request(p, output_len)

        before = await self.metrics()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t0
        return summarize("fixed", concurrency, list(results), dt, metric_rates(before, await self.metrics()))

    async def agentic(self, num_conversations: int, num_turns: int, first_len: int, turn_len: int,
                      output_len: int) -> RunSummary:
        """Conversations side by side; the turns of one conversation one after another."""
        rng = random.Random(self.cfg.seed * 1000 + 7)
        convs = agentic_workload(num_conversations, num_turns, first_len, turn_len, rng, self.cfg.token_range)
        await self.model()

        async def conversation(turns):
            return [await self._request(p, output_len) for p in turns]

        before = await self.metrics()
        t0 = time.perf_counter()
        per_conv = await asyncio.gather(*(conversation(c) for c in convs))
        dt = time.perf_counter() - t0
        results = [r for rs in per_conv for r in rs]
        summary = summarize("agentic", num_conversations, results, dt, metric_rates(before, await self.metrics()))
        summary.per_turn = per_turn(per_conv)
        return summary


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(runs: list[RunSummary]) -> str:
    head = (f"{'workload':>8} {'conc':>5} {'reqs':>5} {'in tok':>8} {'out tok':>8} {'out tok/s':>10} "
            f"{'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'TPOT p50 ms':>11} {'TPOT p99 ms':>11} {'prefix hit':>10} "
            f"{'MTP acc':>8} {'steps':>6} {'step ms':>7} {'period ms':>9} {'wait ms':>7} {'eager':>6} {'eager ms':>8} {'jit':>4}")
    rows = [head]
    for r in runs:
        rows.append(f"{r.workload:>8} {r.concurrency:>5} {r.num_requests:>5} {r.input_tokens:>8} {r.output_tokens:>8} "
                    f"{r.output_tok_s:>10.1f} {_f(r.ttft_ms['median']):>11} {_f(r.ttft_ms['p99']):>11} "
                    f"{_f(r.tpot_ms['median'], '{:.2f}'):>11} {_f(r.tpot_ms['p99'], '{:.2f}'):>11} "
                    f"{_f(r.prefix_cache_hit_rate, '{:.3f}'):>10} {_f(r.mtp_acceptance, '{:.3f}'):>8} "
                    f"{_f(r.engine_steps, '{:.0f}'):>6} {_f(r.engine_step_ms, '{:.2f}'):>7} "
                    f"{_f(r.engine_period_ms, '{:.2f}'):>9} {_f(r.engine_wait_ms, '{:.2f}'):>7} "
                    f"{_f(r.engine_eager_steps, '{:.0f}'):>6} {_f(r.engine_eager_step_ms, '{:.2f}'):>8} "
                    f"{_f(r.engine_triton_compiles, '{:.0f}'):>4}")
    return "\n".join(rows)


def to_json(runs: list[RunSummary], cfg: BenchConfig, extra: dict | None = None) -> dict:
    return {"base_url": cfg.base_url, "model": cfg.model, "seed": cfg.seed, **(extra or {}),
            "runs": [asdict(r) for r in runs]}


# ------------------------------------------------------------------ CLI
def _ints(name: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{name}: {text!r} is not a comma-separated list of integers") from None
    if not vals or min(vals) < 1:
        raise CLIError(f"{name}: {text!r} needs integers >= 1")
    return vals


def _int(name: str, text: str, lo: int = 1) -> int:
    try:
        v = int(text)
    except ValueError:
        raise CLIError(f"{name}: {text!r} is not an integer") from None
    if v < lo:
        raise CLIError(f"{name}: {v} is below {lo}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--base-url", default="http://127.0.0.1:8000", help="server root (default http://127.0.0.1:8000)")
    a("--model", default=None, help="model name to send (default: the first of /v1/models)")
    a("--api-key", default=None, help="bearer key, if the server wants one")
    a("--workload", default="all", choices=("fixed", "agentic", "all"), help="which workload(s) to run")
    a("--concurrency", default="1,4,16,64", help="fixed workload: comma-separated concurrencies")
    a("--num-prompts", default=None, help="fixed workload: requests per concurrency (default 2 x concurrency)")
    a("--input-len", default="1024", help="fixed workload: prompt tokens")
    a("--output-len", default="128", help="fixed workload: output tokens")
    a("--conversations", default="4", help="agentic: conversations in parallel")
    a("--turns", default="12", help="agentic: turns per conversation (10-15 is typical)")
    a("--first-turn-len", default="4096", help="agentic: prompt tokens of the first turn")
    a("--turn-len", default="800", help="agentic: tokens added per later turn")
    a("--turn-output-len", default="128", help="agentic: output tokens per turn")
    a("--token-range", default="1000:30000", help="prompt token ids are drawn uniformly from LO:HI")
    a("--seed", default="0", help="workload seed")
    a("--timeout", default="600", help="seconds per request")
    a("--json", default=None, help="write the results here as JSON")
    a("--plot", default=None, metavar="DIR", help="also draw the results as SVG charts in DIR (made if missing)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    try:
        lo, hi = (int(x) for x in args.token_range.split(":"))
    except ValueError:
        raise CLIError(f"--token-range: {args.token_range!r} is not LO:HI") from None
    if not 0 <= lo < hi:
        raise CLIError(f"--token-range: {args.token_range!r} needs 0 <= LO < HI")
    return BenchConfig(args.base_url, args.model, args.api_key, float(_int("--timeout", args.timeout)),
                       _int("--seed", args.seed, 0), (lo, hi))


async def run_suite(args: argparse.Namespace, cfg: BenchConfig) -> list[RunSummary]:
    bench = Bench(cfg)
    runs = []
    try:
        if args.workload in ("fixed", "all"):
            inp, out = _int("--input-len", args.input_len), _int("--output-len", args.output_len)
            for c in _ints("--concurrency", args.concurrency):
                n = _int("--num-prompts", args.num_prompts) if args.num_prompts else 2 * c
                runs.append(await bench.fixed(c, n, inp, out))
        if args.workload in ("agentic", "all"):
            runs.append(await bench.agentic(_int("--conversations", args.conversations), _int("--turns", args.turns),
                                            _int("--first-turn-len", args.first_turn_len),
                                            _int("--turn-len", args.turn_len, 0),
                                            _int("--turn-output-len", args.turn_output_len)))
    except (httpx.HTTPError, BenchError) as e:
        raise CLIError(f"{cfg.base_url}: {type(e).__name__}: {e}") from None
    finally:
        await bench.close()
    return runs


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    problem = args.plot and plot_dir_problem(args.plot)
    if problem:
        raise CLIError(problem)
    runs = asyncio.run(run_suite(args, cfg))
    for r in runs:
        if r.per_turn:
            print(turn_table(r.per_turn))
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(runs, cfg), f, indent=1)
    if args.plot:
        try:
            paths = write_plots(runs, args.plot)
        except OSError as e:
            raise CLIError(f"--plot: {args.plot!r}: {e.strerror or e}") from None
        print("charts: " + (", ".join(paths) if paths else "none (fixed charts need two concurrencies)"))
    return 0
