"""`nvl72 serve`: start the OpenAI-compatible HTTP server (embedded tiny default model if --model is not given)."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from nvl72.cli import CLIError
from nvl72.engine.sizes import parse_sizes

HELP = "start the OpenAI-compatible HTTP server (embedded tiny default model if --model is not given)"
log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "triton", "flashinfer", "torch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Values are checked in `options()` so that each bad one becomes a CLIError naming it.
    a = parser.add_argument
    a("--model", default=None, help="checkpoint directory (config.json, safetensors, tokenizer); "
                                    "default: the embedded tiny Qwen3.5-MoE with dummy weights")
    a("--load-format", default="auto", help=f"one of {', '.join(LOAD_FORMATS)} (dummy: random weights, real shapes)")
    a("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server)")
    a("--port", default="8000", help="TCP port (default 8000)")
    a("--api-key", default=os.environ.get("NVL72_API_KEY"),
      help="require 'Authorization: Bearer KEY' on /v1 routes (default: $NVL72_API_KEY, else no key)")
    a("--served-model-name", default=None, help="model name clients send (default: the checkpoint dir name)")
    a("--max-model-len", default=None, help="context length in tokens (default: the model's, at most 8192)")
    a("--dtype", default="auto", help=f"one of {', '.join(DTYPES)} (auto: bfloat16 on GPU, float32 on CPU)")
    a("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    a("--num-speculative-tokens", default="0", help="draft tokens per step (MTP head when the model has one)")
    a("--max-num-seqs", default="64", help="most sequences in one batch")
    a("--max-num-batched-tokens", default="2048", help="most tokens in one forward (chunked prefill)")
    a("--page-size", default="16", help="tokens per KV page")
    a("--num-pages", default=None, help="KV pages (default: from --kv-cache-memory)")
    a("--kv-cache-memory", default=None,
      help="KV cache size, e.g. 4GiB or 512MiB (default: 90%% of free GPU memory; on CPU enough for max-num-seqs)")
    a("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    a("--attention-backend", default="auto",
      help="auto (flashinfer where it imports, else triton on GPU; torch on CPU; $NVL72_ATTN_BACKEND "
           "overrides), flashinfer, triton or torch")
    a("--enforce-eager", action="store_true", help="no CUDA graphs (decode nor prefill)")
    a("--no-async-scheduling", action="store_true",
      help="schedule each step after the previous one's tokens are read back (default: the next step is "
           "prepared while one runs, with CUDA graphs)")
    a("--cuda-graph-sizes", default=None,
      help="decode batch sizes captured in CUDA graphs, comma-separated (default: 1,2,4,8,16,...,max-num-seqs)")
    a("--prefill-graph-sizes", default=None,
      help="token counts of prefill / mixed steps captured as piecewise CUDA graphs (attention and GDN mixing "
           "eager between pieces), comma-separated, or 0 for none (default: 16,32,64,128, every 256 to 2048, "
           "every 1024 beyond, max-num-batched-tokens)")
    a("--data-parallel-size", default="1",
      help="engines behind this front, one per GPU (cuda:0..N-1), requests routed to the least loaded")
    a("--engine", default="auto",
      help="thread: the engine loop in a thread of the server process; process: its own process over ZeroMQ "
           "(the front's Python then does not compete with it for the GIL); auto: process on GPU, thread on CPU")
    a("--seed", default="0", help="seed of requests that sample without their own seed (and of dummy weights)")
    a("--max-body-bytes", default=str(8 << 20), help="largest accepted request body (default 8 MiB)")


@dataclass
class ServeOptions:
    model: str | None
    load_format: str
    host: str
    port: int
    api_key: str | None
    served_model_name: str
    max_model_len: int | None
    dtype: str
    device: str
    num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    num_pages: int | None
    kv_cache_bytes: int | None
    enable_prefix_caching: bool
    seed: int
    max_body_bytes: int
    engine: str = "thread"  # thread | process
    data_parallel_size: int = 1
    attention_backend: str = "auto"
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    prefill_graph_sizes: tuple[int, ...] | None = None
    async_scheduling: bool | None = None  # None: the engine's default (on with CUDA graphs)

    def engine_devices(self) -> list[str]:
        """One device per data-parallel engine."""
        if self.data_parallel_size == 1 or self.device == "cpu":
            return [self.device] * self.data_parallel_size
        return [f"cuda:{i}" for i in range(self.data_parallel_size)]

    def engine_kwargs(self) -> dict[str, Any]:
        """Arguments of the engine builder (nvl72.engine.core.build_engine's names)."""
        return dict(model=self.model, load_format=self.load_format, dtype=self.dtype, device=self.device,
                    max_model_len=self.max_model_len, num_speculative_tokens=self.num_speculative_tokens,
                    max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                    page_size=self.page_size, num_pages=self.num_pages, kv_cache_bytes=self.kv_cache_bytes,
                    enable_prefix_caching=self.enable_prefix_caching, seed=self.seed,
                    attention_backend=self.attention_backend, enforce_eager=self.enforce_eager,
                    cuda_graph_batch_sizes=self.cuda_graph_sizes, prefill_graph_sizes=self.prefill_graph_sizes,
                    async_scheduling=self.async_scheduling)


def _int(name: str, value: str | None, lo: int, hi: int | None = None) -> int | None:
    if value is None:
        return None
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise CLIError(f"--{name}={value!r} is not an integer") from None
    if v < lo or (hi is not None and v > hi):
        raise CLIError(f"--{name}={v} is out of range [{lo}, {hi if hi is not None else 'inf'}]")
    return v


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(name: str, value: str | None) -> int | None:
    """'4GiB', '512MiB', '1000000' -> bytes."""
    if value is None:
        return None
    s = value.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        n = float(num)
    except ValueError:
        raise CLIError(f"--{name}={value!r} is not a size (e.g. 4GiB, 512MiB)") from None
    if unit not in _UNITS or n <= 0:
        raise CLIError(f"--{name}={value!r} is not a positive size with a unit in {sorted(k for k in _UNITS if k)}")
    return int(n * _UNITS[unit])


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def _check_host(host: str) -> str:
    """An IP literal or a syntactically valid host name (binding reports one that does not resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host):
            raise CLIError(f"--host={host!r} is neither an IP address nor a host name") from None
    return host


def _engine_mode(mode: str, device: str) -> str:
    """Measured on one H200 (tiny preset, 64 streams x 128 tokens, client in its own process): HTTP
    throughput 0.70 of the engine's alone with a thread engine, 0.94 with a process engine."""
    if mode not in ("auto", "thread", "process"):
        raise CLIError(f"--engine={mode!r} is not one of auto, thread, process")
    if mode != "auto":
        return mode
    if device == "auto":
        import torch

        return "process" if torch.cuda.is_available() else "thread"
    return "process" if device.startswith("cuda") else "thread"


def _graph_sizes(text: str | None, most: int, option: str = "cuda-graph-sizes", unit: str = "batch sizes",
                 limit: str = "max-num-seqs") -> tuple[int, ...] | None:
    """A comma-separated list of sizes in [1, most] (`parse_sizes`)."""
    if text is None:
        return None
    try:
        sizes = parse_sizes(text, f"--{option}", unit)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if not sizes or sizes[-1] > most:
        raise CLIError(f"--{option}={text!r}: sizes must lie in [1, --{limit}={most}]")
    return sizes


def options(args: argparse.Namespace) -> ServeOptions:
    """Check every value; a bad one raises CLIError naming it."""
    model = args.model
    if model is not None:
        if not os.path.isdir(model):
            raise CLIError(f"--model={model!r} is not a directory")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise CLIError(f"--model={model!r} has no config.json")
    if args.load_format not in LOAD_FORMATS:
        raise CLIError(f"--load-format={args.load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if args.dtype not in DTYPES:
        raise CLIError(f"--dtype={args.dtype!r} is not one of {', '.join(DTYPES)}")
    device = args.device
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise CLIError(f"--device={device!r} is not one of auto, cpu, cuda, cuda:N")
    dp = _int("data-parallel-size", args.data_parallel_size, 1, 1024)
    if device.startswith("cuda:") and dp > 1:
        raise CLIError(f"--device={device!r} names one GPU but --data-parallel-size={dp} needs {dp}")
    if device.startswith("cuda") or (device == "auto" and dp > 1):
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = int(device[5:]) + 1 if ":" in device else dp
        if need > n:
            raise CLIError(f"--device={device!r} with --data-parallel-size={dp} needs {need} CUDA device(s), "
                           f"this machine has {n}")
    if args.api_key is not None and not args.api_key.strip():
        raise CLIError("--api-key is empty")
    name = args.served_model_name
    if name is None:
        from nvl72.presets import DEFAULT_MODEL_NAME

        name = os.path.basename(os.path.normpath(model)) if model else DEFAULT_MODEL_NAME
    if not name.strip():
        raise CLIError(f"--served-model-name={name!r} is empty")
    if args.attention_backend not in ATTENTION_BACKENDS:
        raise CLIError(f"--attention-backend={args.attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    max_num_seqs = _int("max-num-seqs", args.max_num_seqs, 1, 65536)
    max_tokens = _int("max-num-batched-tokens", args.max_num_batched_tokens, 1)
    return ServeOptions(
        model=model, load_format=args.load_format, host=_check_host(args.host), port=_int("port", args.port, 1, 65535),
        api_key=args.api_key, served_model_name=name, max_model_len=_int("max-model-len", args.max_model_len, 16),
        dtype=args.dtype, device=device,
        num_speculative_tokens=_int("num-speculative-tokens", args.num_speculative_tokens, 0, 16),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        page_size=_int("page-size", args.page_size, 1, 4096), num_pages=_int("num-pages", args.num_pages, 1),
        kv_cache_bytes=parse_bytes("kv-cache-memory", args.kv_cache_memory),
        enable_prefix_caching=not args.no_prefix_caching, seed=_int("seed", args.seed, 0, 2**63 - 1),
        max_body_bytes=_int("max-body-bytes", args.max_body_bytes, 1024), engine=_engine_mode(args.engine, device),
        data_parallel_size=dp, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        cuda_graph_sizes=_graph_sizes(args.cuda_graph_sizes, max_num_seqs),
        prefill_graph_sizes=() if (args.prefill_graph_sizes or "").strip() == "0" else _graph_sizes(  # 0: none
            args.prefill_graph_sizes, max_tokens, "prefill-graph-sizes", "token counts", "max-num-batched-tokens"),
        async_scheduling=False if args.no_async_scheduling else None)


def load_tokenizer(model: str | None):
    """The checkpoint's tokenizer, or the shipped Qwen3.5 vocabulary for the embedded model."""
    from nvl72.tokenizer import Tokenizer, TokenizerError

    try:
        if model is None:
            from nvl72.config import ModelConfig
            from nvl72.presets import DEFAULT_CONFIG

            return Tokenizer.qwen(ModelConfig.from_dict(DEFAULT_CONFIG).vocab_size)
        return Tokenizer.from_dir(model)
    except TokenizerError as e:
        raise CLIError(f"--model={model!r}: {e}") from e


def start_engine(opts: ServeOptions):
    """The EngineClient the front talks to: one local engine, or a least-loaded router over one
    engine per device when --data-parallel-size > 1."""
    from nvl72.engine.client import start_local_engine
    from nvl72.server.router import LeastLoadedRouter

    engines = []
    try:
        for dev in opts.engine_devices():
            engines.append(start_local_engine(**{**opts.engine_kwargs(), "device": dev},
                                              process=opts.engine == "process"))
    except ValueError as e:  # ConfigError, bad sizes: the user's values
        raise CLIError(str(e)) from e
    return engines[0] if len(engines) == 1 else LeastLoadedRouter(engines)


def run(args: argparse.Namespace) -> int:
    from nvl72.server.app import ServerConfig, build_app
    from nvl72.server.runner import serve_forever

    opts = options(args)
    tok = load_tokenizer(opts.model)
    log.info("tokenizer: %s (%d tokens), chat template: %s", tok.source, tok.vocab_size,
             "checkpoint" if tok.chat_template else "built-in Qwen3 format")
    log.info("%d engine(s) on %s, each in a %s (--engine)", opts.data_parallel_size, ", ".join(opts.engine_devices()),
             opts.engine)
    engine = start_engine(opts)
    app = build_app(engine, tok, ServerConfig(served_model_name=opts.served_model_name, api_key=opts.api_key,
                                              max_body_bytes=opts.max_body_bytes))
    if opts.host not in ("127.0.0.1", "localhost", "::1") and opts.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it", opts.host)
    log.info("serving %r on http://%s:%d (max_model_len %d)", opts.served_model_name, opts.host, opts.port,
             engine.max_model_len)
    serve_forever(app, opts.host, opts.port, log_level=logging.getLevelName(logging.getLogger().level).lower())
    return 0
