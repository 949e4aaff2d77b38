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
from nvl72.model.batch import ForwardBatch
from nvl72.model.dp_ep import mtp_pass


@dataclass
class DraftInput:
    """What a drafter may use: the finished step and, per scheduled sequence, how many fed tokens
    were accepted (their hidden states are valid) — 0 for sequences that finished or were aborted."""

    step: StepResult
    scheduled: list[ScheduledSeq]
    num_accepted: list[int]
    want: list[bool]  # per scheduled sequence: propose drafts for it


class Drafter(abc.ABC):
    sync = None  # a DP+EP rank's PassSync (set by the engine); drafters that run model passes call its before()

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


class MTPDrafter(Drafter):
    """Drafts with the model's MTP head (Qwen3-Next / Qwen3.5), EAGLE-style.

    The MTP layer has its own KV (a cache layer after the decoder's, same page table): its entry at
    position p comes from (token p+1, target hidden at p). After every step the drafter first
    extends that KV over the step's accepted positions (every sequence, prefill chunks included,
    so the MTP context stays complete); the last row of a decoding sequence gives draft 1. Drafts
    2..k feed the previous draft with the MTP's own output hidden at the next position (the
    scheduler reserves pages `k` tokens ahead for these writes; later steps overwrite them).
    Drafts are the argmax of the MTP logits. A prefix-cache hit reuses the MTP KV of the cached
    pages, whose last entry may have been built from a different next token: drafts may then be
    worse, never the output (verification is exact)."""

    def bind(self, model, caches, page_size: int, device: torch.device) -> None:
        if getattr(model, "mtp", None) is None:
            raise ValueError("MTPDrafter needs a model built with its MTP head (config mtp_num_hidden_layers > 0)")
        self.model, self.caches, self.page_size, self.device = model, caches, page_size, torch.device(device)

    @torch.inference_mode()
    def propose(self, inp: DraftInput) -> list[list[int]]:
        qsl = inp.step.batch.query_start_loc.tolist()
        rows, ids, pos, cu, lens, tables, want_row = [], [], [], [0], [], [], []
        live = []
        for i, (s, n) in enumerate(zip(inp.scheduled, inp.num_accepted)):
            if n == 0:
                continue
            seq, start = s.seq, s.seq.num_computed - n  # num_computed already advanced by commit
            live.append(i)
            rows.extend(range(qsl[i], qsl[i] + n))
            ids.extend(seq.all_ids[start + 1:start + n + 1])
            pos.extend(range(start, start + n))
            cu.append(cu[-1] + n)
            lens.append(start + n)
            tables.append(seq.pages)
            want_row.append(inp.want[i])
        out: list[list[int]] = [[] for _ in inp.scheduled]
        if not live:
            return out
        batch = self._batch(ids, pos, cu, lens, tables, [cu[j + 1] - 1 for j, w in enumerate(want_row) if w])
        self._before_pass()
        hidden = self.model.forward_mtp(batch, self.caches, inp.step.hidden[torch.tensor(rows, device=self.device)])
        drafted = [i for i, w in zip(live, want_row) if w]
        if not drafted:
            return out
        last = hidden[batch.logits_indices]  # [N, H]
        tok = self.model.compute_logits(last).argmax(-1)  # [N]
        for i, t in zip(drafted, tok.tolist()):
            out[i].append(t)
        for j in range(1, self.num_tokens):
            seqs = [inp.scheduled[i].seq for i in drafted]
            n = len(seqs)
            batch = self._batch(tok.tolist(), [s.num_computed - 1 + j for s in seqs], list(range(n + 1)),
                                [s.num_computed + j for s in seqs], [s.pages for s in seqs], list(range(n)))
            self._before_pass()
            last = self.model.forward_mtp(batch, self.caches, last)
            tok = self.model.compute_logits(last).argmax(-1)
            for i, t in zip(drafted, tok.tolist()):
                out[i].append(t)
        return out

    def _before_pass(self) -> None:
        """DP+EP: wait for the other ranks' lower passes (every call here is forward_mtp's step 0)."""
        if self.sync is not None:
            self.sync.before(mtp_pass(0))

    def _batch(self, ids, pos, cu, lens, tables, logits_idx) -> ForwardBatch:
        width = max(len(t) for t in tables)
        table = torch.full((len(tables), width), -1, dtype=torch.int32)
        for r, t in enumerate(tables):
            table[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
        d = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=d),
            positions=torch.tensor(pos, dtype=torch.long, device=d),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=d),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=d),
            page_table=table.to(d),
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=d),
        )
