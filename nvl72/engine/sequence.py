"""`Sequence`: all per-request state of the engine, in one place (nano-vllm's split)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from nvl72.engine.protocol import SamplingParams, TokenLogprob


# Async scheduling: the value in `all_ids` of a token the step in flight is still sampling.
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    # Disaggregated serving: a prefill-only request holds its pages and state after its first
    # token until the transfer is done (PARKED); a decode rank holds pages and a slot for a
    # request whose KV and state are arriving (RECEIVING). Neither is scheduled.
    PARKED = "parked"
    RECEIVING = "receiving"


@dataclass(eq=False)
class Sequence:
    request_id: str
    all_ids: list[int]  # prompt then generated tokens; only `append` grows it
    num_prompt: int
    params: SamplingParams
    arrival: int  # admission order; preemption picks the youngest
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    # Tokens whose KV (and GDN state) are in the cache. While decoding this is len(all_ids) - 1:
    # the last sampled token is fed in the next step.
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)  # KV page ids, in order
    state_slot: int = -1  # GDN slot holding the state after num_computed tokens (one reference)
    tree_cursor: object = None  # where this sequence's last prefix-tree insertion ended
    num_cached_tokens: int = 0  # prefix-cache hit of the first admission (reported to the front)
    drafts: list[int] = field(default_factory=list)  # speculative tokens to verify next step
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Bookkeeping for streaming: how many output tokens were already sent to the front.
    num_sent: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    admitted_once: bool = False
    prefill_only: bool = False  # park after the first token (disaggregated prefill)
    arrival_time: float = field(default_factory=time.monotonic)
    queue_time: float | None = None  # arrival -> first scheduling, set once by the scheduler
    queue_time_sent: bool = False
    # Async scheduling: the last of all_ids is PENDING_TOKEN, sampled by the step in flight and read
    # back one step later; `final_pending`: that token ends the sequence whatever its value (a
    # length limit), so it is not scheduled again.
    pending: bool = False
    final_pending: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def num_output(self) -> int:
        return len(self.all_ids) - self.num_prompt

    @property
    def in_prefill(self) -> bool:
        """True while more than one known token lacks KV (prompt, or recompute after preemption).

        A step feeds `all_ids[num_computed:]` (whole or in chunks); the step that reaches the end
        samples. Decoding is the case of a single missing token (plus speculative drafts)."""
        return self.num_computed < self.num_tokens - 1
