"""The engine core: one `LLMEngine` plus its message handling, run in a thread or a process.

`EngineCore` turns protocol messages into engine calls and engine steps into `RequestOutput`s;
`build_engine` makes an engine from plain (JSON-able) arguments; `main` is the separate-process
entry point (`python -m nvl72.engine.core`), speaking msgpack over ZeroMQ: it PULLs `AddRequest`,
`AbortRequest` and `Shutdown` from the client and PUSHes each step's `RequestOutput`s as one
`OutputBatch`, plus a `LoadReport` every `report_interval` seconds (the first one says "ready", later ones are the heartbeat).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import time

import torch

from nvl72.engine.engine import EngineConfig, InvalidRequest, LLMEngine
from nvl72.engine.protocol import AbortRequest, AddRequest, LoadReport, Message, OutputBatch, RequestOutput, Shutdown
from nvl72.engine.spec import HistoryDrafter, MTPDrafter, ngram_proposal

log = logging.getLogger(__name__)

# Used when nvl72.presets (the server's embedded default model) is not importable.
_FALLBACK_CONFIG = dict(
    model_type="qwen3_next", vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4, mtp_num_hidden_layers=1,
    max_position_embeddings=4096, eos_token_id=[0], rms_norm_eps=1e-6,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_config() -> dict:
    try:
        from nvl72.presets import DEFAULT_CONFIG
    except ImportError:
        return dict(_FALLBACK_CONFIG)
    return dict(DEFAULT_CONFIG)


def build_engine(model: str | None = None, *, load_format: str = "auto", dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, num_speculative_tokens: int = 0, speculative_method: str = "auto",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, page_size: int = 16,
                 num_pages: int | None = None, kv_cache_bytes: int | None = None, num_state_slots: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True, seed: int = 0,
                 attention_backend: str | None = None, enforce_eager: bool = False,
                 cuda_graph_batch_sizes: tuple[int, ...] | None = None,
                 prefill_graph_sizes: tuple[int, ...] | None = None, async_scheduling: bool | None = None,
                 warmup: bool | None = None, parallel=None) -> LLMEngine:
    """An engine from plain arguments. `model=None`: the embedded default config with dummy weights.
    `warmup` (default: on CUDA, except DP+EP ranks): `LLMEngine.warmup()`, then `freeze_heap()`.
    `parallel`: this rank's `ParallelLayout` (TP/EP ranks running one engine in lockstep)."""
    from nvl72.config import ModelConfig
    from nvl72.model.loader import load_model, prepare_experts

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    if speculative_method not in ("auto", "mtp", "ngram"):
        raise ValueError(f"speculative_method={speculative_method!r} is not one of auto, mtp, ngram")
    config = ModelConfig.from_dict(default_model_config()) if model is None else ModelConfig.from_pretrained(model)
    if model is None:
        load_format = "dummy"
    use_mtp = num_speculative_tokens > 0 and speculative_method != "ngram" and config.has_mtp
    if speculative_method == "mtp" and num_speculative_tokens > 0 and not config.has_mtp:
        raise ValueError(f"speculative_method='mtp' but the {config.model_type} config has no MTP layer")
    net = load_model(model, config=config, dtype=_DTYPES[dtype], device=device, load_format=load_format,
                     enable_mtp=use_mtp, seed=seed, parallel=parallel)
    prepare_experts(net)
    drafter = None
    if num_speculative_tokens > 0:
        drafter = MTPDrafter(num_speculative_tokens) if use_mtp else HistoryDrafter(num_speculative_tokens, ngram_proposal)
    max_model_len = max_model_len or min(config.max_position_embeddings, 8192)
    cfg = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max(max_num_batched_tokens, 1 + num_speculative_tokens),
                       page_size=page_size, num_pages=num_pages, kv_cache_bytes=kv_cache_bytes,
                       num_state_slots=num_state_slots, num_speculative_tokens=num_speculative_tokens,
                       enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
                       seed=seed, attention_backend=attention_backend, enforce_eager=enforce_eager,
                       cuda_graph_batch_sizes=None if cuda_graph_batch_sizes is None else tuple(cuda_graph_batch_sizes),
                       prefill_graph_sizes=None if prefill_graph_sizes is None else tuple(prefill_graph_sizes),
                       async_scheduling=async_scheduling)
    log.info("engine model %s (%s, %s on %s), drafter %s", model or "<embedded default>", config.model_type, dtype,
             device, type(drafter).__name__ if drafter else "none")
    engine = LLMEngine(net, cfg, drafter=drafter, eos_token_ids=list(config.eos_token_id))
    if warmup if warmup is not None else (device.startswith("cuda") and not engine.dp_ep):
        t0 = time.perf_counter()
        n = engine.warmup()
        log.info("engine warm-up (one %d-token prefill + decode) took %.1f s", n, time.perf_counter() - t0)
        freeze_heap()
    return engine


def freeze_heap() -> int:
    """Once the engine is built and warm: collect what is garbage now, then move every live object
    (model, engine, imports) to the cyclic collector's permanent generation, so that its full passes
    scan only what serving allocates. A full pass over a 48-layer Qwen3-30B-A3B model's ~320K objects
    took 130 ms on a 2-core CPU, a pause that would land inside a step (vLLM and SGLang freeze after
    start-up too). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("engine: %d objects frozen out of the garbage collector's passes", n)
    return n


class EngineCore:
    """Message handling around an engine; single-threaded (the caller's loop owns it)."""

    def __init__(self, engine: LLMEngine, rank: int = 0):
        self.engine = engine
        self.rank = rank
        self.stopped = False

    def handle(self, msg: Message) -> list[RequestOutput]:
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(msg)
            except InvalidRequest as e:
                return [RequestOutput(msg.request_id, [], "error", len(msg.prompt_token_ids), error=str(e))]
            return []
        if isinstance(msg, AbortRequest):
            out = self.engine.abort_request(msg.request_id)
            return [out] if out is not None else []
        if isinstance(msg, Shutdown):
            self.stopped = True
            return []
        raise InvalidRequest(f"engine cannot handle a {msg.KIND!r} message")

    def step(self) -> list[RequestOutput]:
        if not self.engine.has_unfinished():
            return []
        try:
            return self.engine.step()
        except Exception as e:  # an engine bug: fail what is in flight, free it, keep serving
            log.exception("engine step failed")
            outs = []
            for rid in list(self.engine.seqs):
                out = self.engine.abort_request(rid)
                out.finish_reason, out.error = "error", f"{type(e).__name__}: {e}"
                outs.append(out)
            return outs

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def load_report(self) -> LoadReport:
        st = self.engine.stats()
        st["max_model_len"] = float(self.engine.config.max_model_len)
        st["vocab_size"] = float(self.engine.vocab_size or 0)
        return LoadReport(self.rank, int(st["running"]), int(st["waiting"]), st["kv_usage"], time.time(), st)

    def close(self) -> list[RequestOutput]:
        outs = [self.engine.abort_request(rid) for rid in list(self.engine.seqs)]
        self.engine.shutdown()
        return outs


def serve_zmq(core: EngineCore, input_addr: str, output_addr: str, report_interval: float = 0.5) -> None:
    """Run `core` against a client's PUSH (input) and PULL (output) sockets until Shutdown or until
    the parent process goes away."""
    import zmq

    from nvl72.engine.protocol import ProtocolError, decode, encode

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(input_addr)
    push.connect(output_addr)
    push.setsockopt(zmq.SNDTIMEO, 10_000)
    parent = os.getppid()
    last_report = 0.0
    was_busy = False
    try:
        while not core.stopped:
            if pull.poll(0 if core.busy else 50):
                outs: list[RequestOutput] = []
                while True:
                    try:
                        raw = pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        outs += core.handle(decode(raw))
                    except (ProtocolError, InvalidRequest) as e:
                        log.error("dropping bad message: %s", e)
                if outs:
                    push.send(encode(OutputBatch(outs)))
            outs = core.step()
            now = time.monotonic()
            busy = core.busy
            # a report when the engine goes idle too, and before that step's outputs: a client that
            # saw its last token then reads counters (a benchmark's /metrics delta) that include
            # the run's last steps, not a heartbeat's older ones
            if now - last_report >= report_interval or (was_busy and not busy):
                push.send(encode(core.load_report()))
                last_report = now
                if os.getppid() != parent:
                    log.error("parent process %d went away; exiting", parent)
                    break
            was_busy = busy
            if outs:  # one message per step, however many requests it advanced
                push.send(encode(OutputBatch(outs)))
        outs = core.close()
        if outs:
            push.send(encode(OutputBatch(outs)))
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nvl72.engine.core", description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="ZeroMQ address the client PUSHes requests to")
    ap.add_argument("--output", required=True, help="ZeroMQ address the client PULLs outputs from")
    ap.add_argument("--engine-args", default="{}", help="build_engine keyword arguments as JSON")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--report-interval", type=float, default=0.5)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine[{args.rank}] %(levelname)s %(message)s")
    kwargs = json.loads(args.engine_args)
    if not isinstance(kwargs, dict):
        raise SystemExit(f"--engine-args must be a JSON object, got {args.engine_args!r}")
    core = EngineCore(build_engine(**kwargs), rank=args.rank)
    stop_on_signals(core)
    serve_zmq(core, args.input, args.output, args.report_interval)
    return 0


def stop_on_signals(core: EngineCore) -> None:
    """SIGTERM / SIGINT end the serving loop after the current step, as a Shutdown message does: the
    open requests are aborted (their clients told so) and the process exits 0. srun, mpirun and a
    terminal's Ctrl-C signal the front and this process together; dying mid-step left the front
    reporting a crashed engine."""
    def stop(signum, frame):
        log.info("%s: stopping after this step", signal.Signals(signum).name)
        core.stopped = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


if __name__ == "__main__":
    sys.exit(main())
