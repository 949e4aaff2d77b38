"""Speculative decoding: pluggable drafters.

After each step the engine asks the drafter for up to `num_tokens` draft tokens per decoding
sequence; the next step feeds `[last token] + drafts` and the target samples at every position.
The engine accepts the longest prefix of drafts that equals what the target sampled, plus the
target's token after it (exact for greedy and for sampling: each emitted token is drawn from the
target's distribution given the accepted prefix). GDN states roll back by index indirection (see
`nvl72.engine.scheduler`), KV of rejected positions is simply overwritten later.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from nvl72.engine.runner import StepResult
from nvl72.engine.scheduler import ScheduledSeq


@dataclass
class DraftInput:
    """What a drafter may use: the finished step and, per scheduled sequence, how many fed tokens
    were accepted (their hidden states are valid) — 0 for sequences that finished or were aborted."""

    step: StepResult
    scheduled: list[ScheduledSeq]
    num_accepted: list[int]
    want: list[bool]  # per scheduled sequence: propose drafts for it


class Drafter(abc.ABC):
    def __init__(self, num_tokens: int):
        if num_tokens < 1:
            raise ValueError(f"a drafter proposes >= 1 token, got num_tokens={num_tokens}")
        self.num_tokens = num_tokens

    @abc.abstractmethod
    def propose(self, inp: DraftInput) -> list[list[int]]:
        """Draft tokens (at most `num_tokens`) for each scheduled sequence with `want` set (empty
        lists elsewhere)."""

    def bind(self, model, caches, page_size: int, device: torch.device) -> None:
        """Called once by the engine with the target model and its caches (drafters that reuse
        them, like the MTP head, keep references)."""


class HistoryDrafter(Drafter):
    """Drafts from a function of the token history (`fn(tokens, k) -> list[int]`); the basis of
    the n-gram drafter and of test drafters."""

    def __init__(self, num_tokens: int, fn):
        super().__init__(num_tokens)
        self.fn = fn

    def propose(self, inp: DraftInput) -> list[list[int]]:
        return [list(self.fn(s.seq.all_ids, self.num_tokens))[:self.num_tokens] if w else []
                for s, w in zip(inp.scheduled, inp.want)]


def ngram_proposal(tokens: list[int], k: int, max_n: int = 3) -> list[int]:
    """Prompt-lookup drafting: continue the latest earlier occurrence of the last n tokens."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []
