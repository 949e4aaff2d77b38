"""`LLMEngine`: the step loop (schedule -> run -> postprocess), single-threaded.

Synchronous, or with async scheduling (vLLM V1's): step n+1 is scheduled and launched while step n
runs on the device, feeding step n's sampled tokens from device memory (a placeholder in
`all_ids` until they are read back); step n's tokens are read back (non-blocking copy, event)
after step n+1 is launched, so outputs and stop conditions come one step late, and a finished
sequence's extra token is dropped. Steps after one that sampled for a sequence with penalties
(which read the host history) or a prefill-only one are scheduled after its read-back; spec
decoding and DP+EP ranks stay synchronous.

The clients in `nvl72.engine.client` drive it from a background thread or a separate process.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from nvl72.cache.pool import OutOfCapacity, RefPool
from nvl72.cache.prefix import PrefixCache
from nvl72.cache.tensors import num_pages_for_budget, zero_slots
from nvl72.engine import jit_watch, prefill_graphs
from nvl72.engine.protocol import AddRequest, RequestOutput, SamplingParams, TokenLogprob
from nvl72.engine.runner import ModelRunner, PriorTokens
from nvl72.engine.sampler import DeviceSample, has_penalty
from nvl72.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from nvl72.engine.sequence import PENDING_TOKEN, Sequence, Status
from nvl72.engine.sizes import parse_sizes
from nvl72.engine.spec import DraftInput, Drafter
from nvl72.model import attn_backends

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20
CPU_KV_BYTES = 1 << 30  # default KV budget on a CPU


class InvalidRequest(ValueError):
    """A request the engine refuses (bad sampling value, prompt too long, duplicate id...)."""


@dataclass
class KVHandoff:
    """One request's cache for a KV transfer: KV of tokens [0, num_tokens) lives in `pages` (in
    order, every KV layer of `ModelCaches`, the MTP layer included), the GDN state after
    num_tokens tokens in slot `state_slot` (-1 on pure-attention models)."""

    request_id: str
    pages: list[int]
    state_slot: int
    num_tokens: int
    token_ids: list[int]  # prompt, plus the first token on the prefill side


@dataclass
class InFlight:
    """Async scheduling: a launched step whose sampled tokens are not read back yet."""

    sample: DeviceSample  # host copies under way (`sample.result()` waits for them)
    device_tokens: torch.Tensor  # the same tokens on the device, fed to the next step
    rows: dict[Sequence, int]  # row of each sequence that sampled
    sync: bool  # the next step needs them on the host first (penalties, prefill-only parking)


def validate_request(req: AddRequest, max_model_len: int, vocab_size: int | None) -> None:
    """Checks that need no engine state (clients run them before sending); raises InvalidRequest
    naming the bad value."""
    p: SamplingParams = req.sampling
    rid = req.request_id
    n = len(req.prompt_token_ids)
    if n == 0:
        raise InvalidRequest(f"request {rid!r}: empty prompt")
    if n >= max_model_len:
        raise InvalidRequest(f"request {rid!r}: prompt of {n} tokens leaves no room in max_model_len={max_model_len}")
    if vocab_size is not None:
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"request {rid!r}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    checks = [
        ("max_tokens", p.max_tokens, p.max_tokens >= 1),
        ("temperature", p.temperature, 0.0 <= p.temperature and math.isfinite(p.temperature)),
        ("top_p", p.top_p, 0.0 < p.top_p <= 1.0),
        ("top_k", p.top_k, p.top_k == -1 or p.top_k >= 1),
        ("min_p", p.min_p, 0.0 <= p.min_p <= 1.0),
        ("repetition_penalty", p.repetition_penalty, p.repetition_penalty > 0.0),
        ("presence_penalty", p.presence_penalty, -2.0 <= p.presence_penalty <= 2.0),
        ("frequency_penalty", p.frequency_penalty, -2.0 <= p.frequency_penalty <= 2.0),
        ("logprobs", p.logprobs, p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS),
    ]
    for name, value, ok in checks:
        if not ok:
            raise InvalidRequest(f"request {rid!r}: {name}={value!r} is out of range")


WARMUP_REQUEST_ID = "nvl72-warmup"


def graph_sizes_from_env() -> tuple[int, ...]:
    """$NVL72_CUDA_GRAPHS: decode batch sizes, comma-separated; () when unset."""
    return parse_sizes(os.environ.get("NVL72_CUDA_GRAPHS", ""), "NVL72_CUDA_GRAPHS", "batch sizes")


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 64 and every 32 beyond, and max_num_seqs: a decode batch pads
    to the next size, so the steps between sizes bound the wasted rows (vLLM spaces them alike)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, min(max_num_seqs, 64) + 1, 8)) + list(range(96, max_num_seqs + 1, 32))
    return tuple(sorted(set(sizes) | {max_num_seqs}))


@dataclass
class EngineConfig:
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    num_pages: int | None = None  # None: from kv_cache_bytes
    # None: 90% of free GPU memory (less the GDN slots); on CPU enough for max_num_seqs full
    # contexts, capped at CPU_KV_BYTES.
    kv_cache_bytes: int | None = None
    # GDN slots: per running sequence its state plus k + 1 transient rows; the rest serve as
    # prefix-cache checkpoints. None: max_num_seqs * (k + 4).
    num_state_slots: int | None = None
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0  # seeds the generators of requests that sample without their own seed
    # Attention backend (nvl72.model.attn_backends): None or "auto" = $NVL72_ATTN_BACKEND, else by
    # capability (triton on CUDA, the torch reference on CPU).
    attention_backend: str | None = None
    # Decode batch sizes captured in CUDA graphs (needs a graph-safe backend: triton). None =
    # $NVL72_CUDA_GRAPHS (e.g. "1,2,4,8,16,32,64"), else on CUDA `default_graph_sizes(max_num_seqs)`;
    # () or enforce_eager: eager.
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # Token counts whose prefill / mixed steps replay piecewise CUDA graphs (attention and GDN mixing
    # eager between the pieces: nvl72.engine.prefill_graphs). None = $NVL72_PREFILL_GRAPHS, else on CUDA
    # `default_sizes(max_num_batched_tokens)`; () or enforce_eager: eager.
    prefill_graph_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False
    # Schedule step n+1 while step n runs (see the module docstring). None: on when decode runs in
    # CUDA graphs; True also works eagerly and on a CPU (where nothing overlaps: for tests).
    async_scheduling: bool | None = None

    def graph_sizes(self, device: torch.device) -> tuple[int, ...]:
        """Sizes to capture; asked-for sizes are tried on any device (and refused with a warning)."""
        if self.enforce_eager:
            return ()
        if self.cuda_graph_batch_sizes is not None:
            return tuple(self.cuda_graph_batch_sizes)
        return graph_sizes_from_env() or (default_graph_sizes(self.max_num_seqs) if device.type == "cuda" else ())

    def prefill_sizes(self, device: torch.device) -> tuple[int, ...]:
        """Token counts to capture piecewise; asked-for sizes are tried on any device (and refused with a warning)."""
        if self.enforce_eager:
            return ()
        if self.prefill_graph_sizes is not None:
            return tuple(self.prefill_graph_sizes)
        env = prefill_graphs.sizes_from_env()
        if env is not None:
            return env
        return prefill_graphs.default_sizes(self.max_num_batched_tokens) if device.type == "cuda" else ()

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                               self.num_speculative_tokens, self.enable_chunked_prefill)


class LLMEngine:
    def __init__(self, model, config: EngineConfig, drafter: Drafter | None = None,
                 eos_token_ids: list[int] | None = None):
        self.model = model
        self.config = config
        self.device = torch.device(getattr(model, "device", None) or next(model.parameters()).device)
        spec = model.cache_spec()
        self.hybrid = bool(spec.state)
        k = config.num_speculative_tokens
        if k and drafter is None:
            raise ValueError(f"num_speculative_tokens={k} needs a drafter")
        if drafter is not None and drafter.num_tokens != k:
            raise ValueError(f"drafter proposes {drafter.num_tokens} tokens, config says num_speculative_tokens={k}")
        num_pages = config.num_pages or self._default_num_pages(spec)
        min_pages = math.ceil((config.max_model_len + k) / config.page_size)
        if num_pages < min_pages:
            raise ValueError(f"num_pages={num_pages} cannot hold one sequence of max_model_len={config.max_model_len} "
                             f"(needs {min_pages} pages of {config.page_size})")
        num_slots = 0
        if self.hybrid:
            num_slots = config.num_state_slots or config.max_num_seqs * (k + 4)
            if num_slots < k + 3:
                raise ValueError(f"num_state_slots={num_slots} < {k + 3} (one sequence with k={k} drafts needs that many)")
        self.caches = spec.allocate(num_pages, config.page_size, num_slots, device=self.device)
        self.pages = RefPool("kv pages", num_pages)
        self.slots = RefPool("gdn slots", num_slots) if self.hybrid else None
        self.prefix = PrefixCache(config.page_size, self.pages, self.slots, hybrid=self.hybrid,
                                  enabled=config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.pages, config.page_size, self.prefix, self.slots,
                                   zero_slot=lambda s: zero_slots(self.caches, [s]))
        if hasattr(model, "attn_backend"):
            name = config.attention_backend or os.environ.get(attn_backends.ENV) or "auto"
            model.attn_backend = attn_backends.select(attn_backends.AttentionShape.of(model), self.device,
                                                      None if name == "auto" else name)
        self.runner = ModelRunner(model, self.caches, config.page_size, self.hybrid, self.device)
        # DP+EP rank (MoE layers through a dispatch): its passes are collectives with the EP group.
        self.dp_ep = getattr(getattr(model, "parallel", None), "dispatch", None) is not None
        sizes = config.graph_sizes(self.device)
        if sizes and self.dp_ep:
            log.info("engine: no decode CUDA graphs on a DP+EP rank (host-synced expert path)")
        elif sizes:
            from nvl72.engine.cuda_graphs import build_decode_graphs

            # One KV page and one GDN slot for the padded rows of graph replays, held for good.
            scratch_page = self.pages.alloc(1)[0]
            scratch_slot = self.slots.alloc(1)[0] if self.hybrid else 0
            self.runner.graphs = build_decode_graphs(model, self.caches, config.page_size, config.max_model_len,
                                                     sizes, 1 + k, self.hybrid,
                                                     scratch_page=scratch_page, scratch_slot=scratch_slot)
            if self.runner.graphs is None:
                self.pages.decref(scratch_page)
                if self.hybrid:
                    self.slots.decref(scratch_slot)
        tokens = config.prefill_sizes(self.device)
        if tokens and self.dp_ep:
            log.info("engine: no prefill CUDA graphs on a DP+EP rank (host-synced expert path)")
        elif tokens:
            self.runner.prefill_graphs = prefill_graphs.build_prefill_graphs(model, self.caches, config.page_size,
                                                                             tokens)
        self.drafter = drafter
        if drafter is not None:
            drafter.bind(model, self.caches, config.page_size, self.device)
        self.overlap = (config.async_scheduling if config.async_scheduling is not None
                        else self.runner.graphs is not None)
        if self.overlap and (drafter is not None or self.dp_ep):
            log.info("engine: async scheduling off (%s)", "speculative decoding" if drafter else "DP+EP rank")
            self.overlap = False
        self._inflight: InFlight | None = None
        self.eos_token_ids = set(eos_token_ids or [])
        self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        self.seqs: dict[str, Sequence] = {}
        self._arrival = 0
        self._rng = torch.Generator().manual_seed(config.seed)
        self.counters = dict(generation_tokens=0, spec_decode_num_drafts=0,
                             spec_decode_num_draft_tokens=0, spec_decode_num_accepted_tokens=0, num_steps=0,
                             step_seconds=0.0,  # host time inside step(): a served run's mean step beside its TPOT
                             # steps whose forward ran outside every CUDA graph (batches beyond the captured
                             # sizes; prefill chunks and mixed steps where no prefill graphs) and their host time
                             num_eager_steps=0, eager_step_seconds=0.0,
                             # a step's start to the next's while requests stay in flight: the caller's
                             # loop period (a served batch-1 TPOT); its excess over step_seconds is the
                             # time the loop spends outside step() (the serving loop's messages)
                             num_step_periods=0, step_period_seconds=0.0,
                             # host time blocked on a launched step's sampled tokens (async scheduling):
                             # near 0 a step means the host, not the device, paces the steps
                             device_wait_seconds=0.0,
                             triton_compiles=0)  # after the warm-up (jit_watch)
        self._last_busy_step: float | None = None  # start of the last step that left requests in flight
        self._eager = False  # the current step's forward ran outside the CUDA graphs
        log.info("engine: %d KV pages of %d tokens (%.1f MiB), %d GDN slots, spec k=%d, prefix cache %s, "
                 "async scheduling %s, device %s",
                 num_pages, config.page_size, num_pages * spec.kv_bytes_per_page(config.page_size) / 2**20,
                 num_slots, k, "on" if config.enable_prefix_caching else "off", "on" if self.overlap else "off",
                 self.device)

    def set_pass_sync(self, sync) -> None:
        """DP+EP: keep this rank's forwards (runner, MTP drafter) in lockstep with its EP group via
        `sync` (a `nvl72.model.dp_ep.PassSync`); the caller ends every step with `sync.finish()`."""
        if not self.dp_ep:
            layout = getattr(self.model, "parallel", None)
            raise ValueError(f"set_pass_sync needs a DP+EP model (parallel.dispatch set), got {layout}")
        self.runner.sync = sync
        if self.drafter is not None:
            self.drafter.sync = sync

    def _default_num_pages(self, spec) -> int:
        c = self.config
        budget = c.kv_cache_bytes
        if budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            slot_bytes = spec.state_bytes_per_slot() * (c.num_state_slots or c.max_num_seqs * (c.num_speculative_tokens + 4))
            budget = int(0.9 * free) - slot_bytes
        if budget is None:
            per_seq = math.ceil((c.max_model_len + c.num_speculative_tokens) / c.page_size)
            return max(per_seq, min(c.max_num_seqs * per_seq, num_pages_for_budget(spec, c.page_size, CPU_KV_BYTES)))
        return num_pages_for_budget(spec, c.page_size, budget)

    # ---------------------------------------------------------------- requests
    def add_request(self, req: AddRequest, *, prefill_only: bool = False) -> None:
        """Queue a request. `prefill_only`: after its first token (if it does not finish there)
        it is parked with its cache for a transfer (`handoff`, then `release`)."""
        seq = self._new_seq(req)
        seq.prefill_only = prefill_only
        self.seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def _new_seq(self, req: AddRequest) -> Sequence:
        self._validate(req)
        p = req.sampling
        gen = None
        if not p.greedy:
            seed = p.seed if p.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
            gen = torch.Generator(device=self.device).manual_seed(seed)
        seq = Sequence(req.request_id, list(req.prompt_token_ids), len(req.prompt_token_ids), p, self._arrival, gen)
        self._arrival += 1
        return seq

    # ---------------------------------------------------------------- disaggregation hooks
    def handoff(self, request_id: str) -> KVHandoff:
        """Where a parked prefill-only request's cache lives (to send it to a decode rank)."""
        seq = self._seq(request_id, Status.PARKED)
        return KVHandoff(request_id, list(seq.pages), seq.state_slot, seq.num_computed, list(seq.all_ids))

    def release(self, request_id: str) -> None:
        """Free a parked request's cache once its transfer is done."""
        seq = self._seq(request_id, Status.PARKED)
        del self.seqs[request_id]
        self.scheduler.remove(seq)

    def reserve_transfer(self, req: AddRequest, num_tokens: int) -> KVHandoff:
        """Decode side: take pages (and a GDN slot) for `num_tokens` tokens of `req` whose KV and
        state will be written by a transfer. Raises OutOfCapacity when they are not free."""
        if not 0 < num_tokens <= len(req.prompt_token_ids):
            raise InvalidRequest(f"request {req.request_id!r}: num_tokens={num_tokens} not in "
                                 f"[1, {len(req.prompt_token_ids)}]")
        seq = self._new_seq(req)
        if not self.scheduler.reserve(seq, num_tokens):
            raise OutOfCapacity(f"request {req.request_id!r}: no room for {num_tokens} tokens of KV "
                                f"({self.pages.num_free} pages free)")
        seq.num_computed = num_tokens
        self.seqs[req.request_id] = seq
        return KVHandoff(req.request_id, list(seq.pages), seq.state_slot, num_tokens, list(seq.all_ids))

    def commit_transfer(self, request_id: str, new_token_ids: list[int]) -> None:
        """The transfer into a reserved request is complete and the prefill side produced
        `new_token_ids` (already streamed by it): the request decodes from the next step."""
        seq = self._seq(request_id, Status.RECEIVING)
        seq.all_ids.extend(new_token_ids)
        seq.num_sent = len(new_token_ids)
        if seq.num_computed != seq.num_tokens - 1:
            raise InvalidRequest(f"request {request_id!r}: {seq.num_computed} tokens of KV arrived for "
                                 f"{seq.num_tokens} known tokens (need exactly one not yet computed)")
        self.scheduler.adopt(seq)

    def _seq(self, request_id: str, status: Status) -> Sequence:
        seq = self.seqs.get(request_id)
        if seq is None or seq.status != status:
            raise InvalidRequest(f"request {request_id!r} is not {status.value} "
                                 f"({'unknown' if seq is None else seq.status.value})")
        return seq

    def _validate(self, req: AddRequest) -> None:
        if req.request_id in self.seqs:
            raise InvalidRequest(f"duplicate request_id {req.request_id!r}")
        validate_request(req, self.config.max_model_len, self.vocab_size)
        c = self.config
        if not c.enable_chunked_prefill and len(req.prompt_token_ids) > c.max_num_batched_tokens:
            raise InvalidRequest(f"request {req.request_id!r}: prompt of {len(req.prompt_token_ids)} tokens exceeds "
                                 f"max_num_batched_tokens={c.max_num_batched_tokens} with chunked prefill off")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request (between steps); None if it is unknown or done."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def warmup(self, num_tokens: int | None = None) -> int:
        """Dummy requests before serving, so no real request pays for kernel JIT: one `num_tokens`
        prefill (default one full chunk) with two decode steps, then a few short prompts together and
        one arriving while they decode, then the same with max_num_seqs prompts. Triton specialises
        on shapes: the first long prompt on an H200 took 745 ms instead of 33 (its contiguous MoE path
        compiled then). Afterwards its pages leave the prefix cache and the counters it moved are
        zeroed. Every rank of a TP instance must call it (its forwards are collectives); not for DP+EP
        ranks (their passes pair with the EP group's). Returns the prefill's token count."""
        if self.dp_ep:
            raise RuntimeError("warmup() on a DP+EP rank: its forwards pair with the other EP ranks'")
        if self.seqs:
            raise RuntimeError(f"warmup() with {len(self.seqs)} requests in the engine")
        n = num_tokens or min(self.config.max_num_batched_tokens, self.config.max_model_len - 3)
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        self.add_request(AddRequest(WARMUP_REQUEST_ID, [1] * n, sp))
        while self.has_unfinished():
            self.step()
        # then the shapes serving meets: several prompts in one step (odd and even lengths), their
        # decode, and a prompt arriving while they decode (a step of decode rows plus a chunk). On an
        # H200 a served benchmark's first concurrency-64 run averaged 7.0 ms a step against 2.5 ms for
        # the same run repeated: Triton compiled the kernels of these shapes in the middle of serving.
        cap = max(1, min(self.config.max_model_len - 4, n))
        self._warm_batch("mixed", [min(length, cap) for length in (1, 3, 17, 100, 301)], min(200, cap), sp)
        # and the widest batches (kernels sized by the sequence count compiled 5 variants in a served
        # concurrency-64 run), with one decode step outside the graphs: what a batch that does not fit
        # them runs
        self._warm_batch("wide", [min(1 + i % 7, cap) for i in range(self.config.max_num_seqs)], min(33, cap), sp,
                         eager_decode=True)
        self.prefix.clear()
        self.scheduler.prefix_queries = self.scheduler.prefix_hits = 0
        for k in self.counters:
            self.counters[k] = 0
        jit_watch.watch(self.counters)
        return n

    def _warm_batch(self, name: str, lengths: list[int], late: int, sp: SamplingParams,
                    eager_decode: bool = False) -> None:
        """Warm-up: prompts of `lengths` tokens prefilled in one step, (`eager_decode`: one decode
        step with the CUDA graphs set aside,) then a `late`-token prompt arriving while they decode;
        runs them all to the end."""
        for i, length in enumerate(lengths):
            self.add_request(AddRequest(f"{WARMUP_REQUEST_ID}-{name}-{i}", [1] * length, sp))
        self.step()
        if eager_decode:
            graphs, self.runner.graphs = self.runner.graphs, None
            try:
                self.step()
            finally:
                self.runner.graphs = graphs
        self.add_request(AddRequest(f"{WARMUP_REQUEST_ID}-{name}-late", [1] * late, sp))
        while self.has_unfinished():
            self.step()

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._last_busy_step is not None:
            self.counters["num_step_periods"] += 1
            self.counters["step_period_seconds"] += t0 - self._last_busy_step
        self._eager = False
        try:
            return self._step_async() if self.overlap else self._step_sync()
        finally:
            self._last_busy_step = t0 if self.has_unfinished() else None
            dt = time.perf_counter() - t0
            self.counters["step_seconds"] += dt
            if self._eager:
                self.counters["num_eager_steps"] += 1
                self.counters["eager_step_seconds"] += dt

    def _fail(self, scheduled: list[ScheduledSeq], e: Exception) -> list[RequestOutput]:
        """The model failed: fail this step's requests, keep the engine alive (not on a DP+EP
        rank, whose EP group's collectives are now out of step: fatal)."""
        if self.dp_ep:
            raise
        log.exception("model step failed")
        outputs = []
        for s in scheduled:
            self.scheduler.release_step(s)
            if s.seq.status == Status.FINISHED:  # ended by the step before (async scheduling)
                continue
            self.seqs.pop(s.seq.request_id, None)
            self.scheduler.remove(s.seq)
            s.seq.finish_reason = "error"
            o = self._output(s.seq)
            o.error = f"{type(e).__name__}: {e}"
            outputs.append(o)
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        prev, self._inflight = self._inflight, None
        if prev is not None and prev.sync:
            outputs += self._resolve(prev)
            prev = None
        out = self.scheduler.schedule()
        if not out.scheduled:
            return outputs + (self._resolve(prev) if prev is not None else [])
        prior = PriorTokens(prev.device_tokens, prev.rows) if prev is not None else None
        try:
            result = self.runner.run(out.scheduled, prior, readback=False)
        except Exception as e:
            if prev is not None:
                outputs += self._resolve(prev)
            return outputs + self._fail(out.scheduled, e)
        sample = result.pending.copy_to_host(self.runner.readback) if result.pending is not None else None
        if prev is not None:
            outputs += self._resolve(prev)  # while this step runs on the device
        self.counters["num_steps"] += 1
        self._eager = not result.graphed
        rows: dict[Sequence, int] = {}
        sync = False
        for r, (i, _) in enumerate(result.sample_rows):
            rows[out.scheduled[i].seq] = r
        for s in out.scheduled:
            seq = s.seq
            if seq.status == Status.FINISHED:  # ended by the previous step's tokens: this one is dropped
                self.scheduler.release_step(s)
                rows.pop(seq, None)
                continue
            if s.samples:
                seq.all_ids.append(PENDING_TOKEN)
                seq.pending = True
                p = seq.params
                seq.final_pending = seq.num_output >= p.max_tokens or seq.num_tokens >= self.config.max_model_len
                sync |= seq.prefill_only or has_penalty(p)
            self.scheduler.commit(s, s.num_new)
        if rows:
            self._inflight = InFlight(sample, result.pending.token_ids, rows, sync)
        return outputs

    def _resolve(self, flight: InFlight) -> list[RequestOutput]:
        """Read back a launched step's tokens (waits for that step only) and postprocess them."""
        t0 = time.perf_counter()
        sampled = flight.sample.result()
        self.counters["device_wait_seconds"] += time.perf_counter() - t0
        outputs = []
        for seq, row in flight.rows.items():
            if seq.status == Status.FINISHED:  # aborted meanwhile: its token is dropped
                continue
            if not seq.pending or seq.all_ids[-1] != PENDING_TOKEN:
                raise RuntimeError(f"{seq.request_id}: no placeholder for the token read back")
            seq.pending = seq.final_pending = False
            seq.all_ids[-1] = sampled.token_ids[row]
            self._check_stop(seq, sampled, row)
            self.counters["generation_tokens"] += 1
            if seq.finish_reason is not None:
                self.seqs.pop(seq.request_id, None)
                self.scheduler.remove(seq)
            elif seq.prefill_only:
                self.scheduler.park(seq)
            outputs.append(self._output(seq))
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        try:
            result = self.runner.run(out.scheduled)
        except Exception as e:
            return self._fail(out.scheduled, e)
        self.counters["num_steps"] += 1
        self._eager = not result.graphed
        tokens = result.sampled.token_ids if result.sampled else []
        by_seq: dict[int, list[int]] = {}
        for r, (i, _) in enumerate(result.sample_rows):
            by_seq.setdefault(i, []).append(r)
        outputs: list[RequestOutput] = []
        accepted = [0] * len(out.scheduled)
        want = [False] * len(out.scheduled)
        for i, s in enumerate(out.scheduled):
            seq = s.seq
            if not s.samples:
                self.scheduler.commit(s, s.num_new)
                accepted[i] = s.num_new
                continue
            rows = by_seq[i]
            sampled = [tokens[r] for r in rows]
            a = 0
            while a < len(s.drafts) and s.drafts[a] == sampled[a]:
                a += 1
            if s.drafts:
                self.counters["spec_decode_num_drafts"] += 1
                self.counters["spec_decode_num_draft_tokens"] += len(s.drafts)
                self.counters["spec_decode_num_accepted_tokens"] += a
            emitted = 0
            for j in range(a + 1):
                self._append(seq, sampled[j], result.sampled, rows[j])
                emitted += 1
                if seq.finish_reason is not None:
                    break
            self.counters["generation_tokens"] += emitted
            accepted[i] = s.num_new - len(s.drafts) + emitted - 1
            self.scheduler.commit(s, accepted[i])
            if seq.finish_reason is not None:
                self.seqs.pop(seq.request_id, None)
                self.scheduler.remove(seq)
                accepted[i] = 0  # its pages are gone: nothing for a drafter to extend
            elif seq.prefill_only:
                self.scheduler.park(seq)  # its first token goes out now; decoding happens elsewhere
            else:
                want[i] = self.drafter is not None
            outputs.append(self._output(seq))
        if self.drafter is not None:  # also on steps without decodes: the MTP head extends its KV
            drafts = self.drafter.propose(DraftInput(result, out.scheduled, accepted, want))
            for s, w, d in zip(out.scheduled, want, drafts):
                if w:
                    s.seq.drafts = list(d)
        return outputs

    def _append(self, seq: Sequence, token: int, sampled, row: int) -> None:
        seq.all_ids.append(token)
        self._check_stop(seq, sampled, row)

    def _check_stop(self, seq: Sequence, sampled, row: int) -> None:
        """After the last of all_ids (sampled row `row`) became known: logprobs, finish reason."""
        p = seq.params
        token = seq.all_ids[-1]
        if p.logprobs is not None:
            seq.pending_logprobs.append(TokenLogprob(token, sampled.logprobs[row], sampled.top_logprobs[row]))
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            seq.finish_reason = "stop"
        elif seq.num_output >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            seq.finish_reason = "length"

    def _output(self, seq: Sequence) -> RequestOutput:
        end = seq.num_tokens - seq.pending  # a placeholder is never sent
        new = seq.all_ids[seq.num_prompt + seq.num_sent:end]
        seq.num_sent = end - seq.num_prompt
        lps = None
        if seq.params.logprobs is not None:
            lps, seq.pending_logprobs = seq.pending_logprobs, []
        queue_time = None
        if seq.queue_time is not None and not seq.queue_time_sent:
            queue_time, seq.queue_time_sent = seq.queue_time, True
        return RequestOutput(seq.request_id, new, seq.finish_reason, seq.num_prompt, seq.num_cached_tokens, lps,
                             queue_time=queue_time)

    # ---------------------------------------------------------------- gauges
    def stats(self) -> dict[str, float]:
        c = self.counters
        used = self.pages.num_used - self.prefix.num_evictable_pages()
        drafts = c["spec_decode_num_drafts"]
        return {
            "running": float(len(self.scheduler.running)),
            "waiting": float(len(self.scheduler.waiting)),
            "kv_usage": used / self.pages.size,
            "kv_pages_total": float(self.pages.size),
            "kv_pages_used": float(self.pages.num_used),
            "state_slots_used": float(self.slots.num_used) if self.slots else 0.0,
            "prefix_cache_queries": float(self.scheduler.prefix_queries),
            "prefix_cache_hits": float(self.scheduler.prefix_hits),
            "num_preemptions": float(self.scheduler.num_preemptions),
            "prompt_tokens": float(self.scheduler.prefix_queries),  # every prompt token, once
            "generation_tokens": float(c["generation_tokens"]),
            "spec_decode_num_drafts": float(drafts),
            "spec_decode_num_draft_tokens": float(c["spec_decode_num_draft_tokens"]),
            "spec_decode_num_accepted_tokens": float(c["spec_decode_num_accepted_tokens"]),
            "num_steps": float(c["num_steps"]),
            "step_seconds": float(c["step_seconds"]),
            "num_eager_steps": float(c["num_eager_steps"]),
            "eager_step_seconds": float(c["eager_step_seconds"]),
            "num_step_periods": float(c["num_step_periods"]),
            "step_period_seconds": float(c["step_period_seconds"]),
            "device_wait_seconds": float(c["device_wait_seconds"]),
            "triton_compiles": float(c["triton_compiles"]),
            "spec_decode_acceptance_rate": c["spec_decode_num_accepted_tokens"] / max(c["spec_decode_num_draft_tokens"], 1),
            "spec_decode_tokens_per_step": (c["spec_decode_num_accepted_tokens"] + drafts) / max(drafts, 1),
        }

    def shutdown(self) -> None:
        """Abort everything and release the prefix tree (all pages and slots return to the pools)."""
        for rid in list(self.seqs):
            self.abort_request(rid)
        self._inflight = None
        self.prefix.clear()
