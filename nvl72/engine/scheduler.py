"""Continuous-batching scheduler: which sequences run this step, with how many new tokens.

Each step it first continues the running sequences (oldest first: decode tokens plus speculative
drafts, or the next chunk of a prefill), then admits waiting ones (FIFO) while the token budget,
`max_num_seqs`, free KV pages and GDN slots allow. Admission looks the prompt up in the prefix
cache. When a running sequence cannot get the pages or slots it needs, the prefix tree evicts
first; then the youngest running sequence is preempted (all its cache freed, recomputed later:
its full pages stay in the prefix tree, so the recompute is mostly a cache hit).

GDN state (hybrid models) is handled by index indirection: a sequence owns one reference on
`state_slot` (the state after `num_computed` tokens); each step gets fresh transient slots for the
positions that write a state (the last token of a chunk, every position of a speculative verify,
optionally one page boundary inside a chunk as a prefix checkpoint). `commit` makes the slot of
the last accepted position the new `state_slot` and gives page-boundary states to the prefix tree;
the rest go back to the pool. No state is ever copied, and a slot is zeroed before a fresh
sequence starts from it.

The scheduler knows nothing of attention math: it hands `ScheduledSeq`s to the runner.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from nvl72.cache.pool import RefPool
from nvl72.cache.prefix import PrefixCache
from nvl72.engine.sequence import Sequence, Status

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    num_speculative_tokens: int = 0
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.max_num_batched_tokens < 1 + self.num_speculative_tokens:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} cannot hold one decode step "
                             f"of {1 + self.num_speculative_tokens} tokens")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens fed this step: all_ids[num_computed:num_computed+num_new] + drafts
    drafts: list[int]  # speculative tokens appended after the known ones (decode only)
    write_offsets: list[int] = field(default_factory=list)  # query offsets that write a GDN state
    write_slots: list[int] = field(default_factory=list)  # transient slot per write offset

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the known tokens (and so sample)?"""
        return self.seq.num_computed + self.num_new - len(self.drafts) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pages: RefPool, page_size: int, prefix: PrefixCache,
                 slots: RefPool | None = None, zero_slot=None):
        """`slots` and `zero_slot(slot)` (zeroes a GDN slot) are given for hybrid models only."""
        self.config = config
        self.pages = pages
        self.page_size = page_size
        self.prefix = prefix
        self.slots = slots
        self.zero_slot = zero_slot
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0

    @property
    def hybrid(self) -> bool:
        return self.slots is not None

    # ---------------------------------------------------------------- queue management
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and free all its cache (finish or abort)."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    def _free(self, seq: Sequence) -> None:
        for p in seq.pages:
            self.pages.decref(p)
        seq.pages = []
        seq.tree_cursor = None
        if seq.state_slot >= 0:
            self.slots.decref(seq.state_slot)
            seq.state_slot = -1
        seq.drafts = []

    def park(self, seq: Sequence) -> None:
        """A running sequence stops being scheduled but keeps its pages and state (handoff)."""
        self.running.remove(seq)
        seq.drafts = []
        seq.status = Status.PARKED

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for `num_tokens` tokens of KV (plus the speculative lookahead) and, on hybrid
        models, a state slot, for a sequence whose cache will be written by a transfer."""
        pages = self._alloc_pages(self._pages_needed(seq, num_tokens))
        if pages is None:
            return False
        if self.hybrid:
            slots = self._alloc_slots(1)
            if slots is None:
                for p in pages:
                    self.pages.decref(p)
                return False
            seq.state_slot = slots[0]
        seq.pages = pages
        seq.status = Status.RECEIVING
        return True

    def adopt(self, seq: Sequence) -> None:
        """A sequence whose KV (and state) for `num_computed` tokens arrived starts decoding; its
        full pages (and a page-aligned state) go to the prefix tree like locally computed ones."""
        seq.status = Status.RUNNING
        seq.admitted_once = True
        self.running.append(seq)
        ckpt = {}
        if self.hybrid and seq.num_computed % self.page_size == 0:
            ckpt = {seq.num_computed // self.page_size - 1: seq.state_slot}
        seq.tree_cursor = self.prefix.insert(seq.all_ids, seq.pages, ckpt, num_tokens=seq.num_computed)

    def preempt(self, seq: Sequence) -> None:
        """Free all cache of a running sequence and queue it first for recompute."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.debug("preempted %s (%d tokens)", seq.request_id, seq.num_tokens)

    # ---------------------------------------------------------------- allocation
    def _alloc_pages(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if self.pages.num_free < n:
            # Evicting walks the tree: free a batch at once so that it happens rarely.
            self.prefix.evict_pages(max(n - self.pages.num_free, self.pages.size // 64))
        if self.pages.num_free < n:
            return None
        return self.pages.alloc(n)

    def _alloc_slots(self, n: int) -> list[int] | None:
        if n <= 0 or not self.hybrid:
            return []
        if self.slots.num_free < n:
            self.prefix.evict_slots(max(n - self.slots.num_free, self.slots.size // 16))
        if self.slots.num_free < n:
            return None
        return self.slots.alloc(n)

    def _pages_needed(self, seq: Sequence, num_new: int) -> int:
        # With speculation, pages reach k tokens further: a drafter (the MTP head) writes its own
        # KV at the positions of the next step's drafts.
        end = seq.num_computed + num_new + self.config.num_speculative_tokens
        return max(-(-end // self.page_size) - len(seq.pages), 0)

    def _reserve(self, seq: Sequence, sched: ScheduledSeq, need_state: bool) -> bool:
        """Allocate pages for the step's tokens and its write slots (all or nothing)."""
        need = self._pages_needed(seq, sched.num_new)
        if need == 0 and not self.hybrid:  # the common decode step: nothing to take
            return True
        new_pages = self._alloc_pages(need)
        if new_pages is None:
            return False
        if self.hybrid:
            offsets = list(range(sched.num_new)) if sched.drafts else [sched.num_new - 1]
            slots = self._alloc_slots(len(offsets) + int(need_state))
            if slots is None:
                for p in new_pages:
                    self.pages.decref(p)
                return False
            if need_state:
                seq.state_slot = slots.pop()
                self.zero_slot(seq.state_slot)
            sched.write_offsets, sched.write_slots = offsets, slots
        seq.pages.extend(new_pages)
        return True

    # ---------------------------------------------------------------- the step
    def _plan_running(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        num_tokens = len(seq.all_ids)
        if seq.num_computed < num_tokens - 1:  # in prefill
            n = min(num_tokens - seq.num_computed, budget)
            return ScheduledSeq(seq, n, []) if n > 0 else None
        if budget < 1:
            return None
        if not seq.drafts:
            return ScheduledSeq(seq, 1, [])
        room = min(budget - 1, self.config.max_model_len - num_tokens,
                   seq.params.max_tokens - (num_tokens - seq.num_prompt) - 1)
        drafts = seq.drafts[:max(room, 0)]
        return ScheduledSeq(seq, 1 + len(drafts), drafts)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if seq.status != Status.RUNNING or seq.final_pending:
                continue  # preempted for an older sequence earlier in this loop, or done but for a read-back
            sched = self._plan_running(seq, budget)
            if sched is None:
                continue
            while not self._reserve(seq, sched, need_state=False):
                if sched.drafts:  # speculation is optional: drop the drafts before preempting anyone
                    sched = ScheduledSeq(seq, 1, [])
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                if seq.drafts:
                    seq.drafts = []
                scheduled.append(sched)
                budget -= sched.num_new
        if not preempted:
            self._admit(scheduled, budget)
        if self.hybrid:
            self._add_checkpoints(scheduled)
        return SchedulerOutput(scheduled, preempted)

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            match = self.prefix.match(seq.all_ids[:seq.num_tokens - 1])
            seq.pages, seq.num_computed, seq.state_slot = match.pages, match.num_tokens, match.slot
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.config.enable_chunked_prefill and n < seq.num_tokens - seq.num_computed:
                self._free(seq)
                seq.num_computed = 0
                break
            sched = ScheduledSeq(seq, n, [])
            if not self._reserve(seq, sched, need_state=self.hybrid and match.slot < 0):
                self._free(seq)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if not seq.admitted_once:
                seq.admitted_once = True
                seq.queue_time = time.monotonic() - seq.arrival_time
                seq.num_cached_tokens = match.num_tokens
                self.prefix_queries += seq.num_prompt
                self.prefix_hits += match.num_tokens
            scheduled.append(sched)
            budget -= n

    def _add_checkpoints(self, scheduled: list[ScheduledSeq]) -> None:
        """Opportunistically write the state at the last page boundary strictly inside a prefill
        chunk into a spare slot (a prefix-cache checkpoint), after all required slots are taken."""
        p = self.page_size
        for s in scheduled:
            if s.drafts or self.slots.num_free == 0:
                continue
            start, end = s.seq.num_computed, s.seq.num_computed + s.num_new
            boundary = (end - 1) // p * p  # last multiple of p strictly before end
            if boundary > start:
                s.write_offsets.insert(0, boundary - start - 1)
                s.write_slots.insert(0, self.slots.alloc(1)[0])

    # ---------------------------------------------------------------- after the forward
    def commit(self, sched: ScheduledSeq, num_accepted: int) -> None:
        """Record that the first `num_accepted` fed tokens are now in the cache (all of a prefill
        chunk; the fed token plus the accepted drafts of a decode). The caller has already
        appended the newly sampled tokens to `seq.all_ids`."""
        seq = sched.seq
        start = seq.num_computed
        seq.num_computed = start + num_accepted
        checkpoints: dict[int, int] = {}
        if self.hybrid:
            last = num_accepted - 1
            keep = -1
            for off, slot in zip(sched.write_offsets, sched.write_slots):
                if off == last:
                    keep = slot
                if off <= last and (start + off + 1) % self.page_size == 0:
                    checkpoints[(start + off + 1) // self.page_size - 1] = slot
            if keep < 0:
                raise RuntimeError(f"{seq.request_id}: no state written at accepted offset {last}")
            self.slots.decref(seq.state_slot)
            seq.state_slot = keep
        if seq.num_computed // self.page_size > start // self.page_size or checkpoints:
            seq.tree_cursor = self.prefix.insert(seq.all_ids, seq.pages, checkpoints, seq.tree_cursor,
                                                 num_tokens=seq.num_computed)
        if self.hybrid:
            for slot in sched.write_slots:
                if slot != seq.state_slot:
                    self.slots.decref(slot)

    def release_step(self, sched: ScheduledSeq) -> None:
        """Return a step's transient slots without committing (its sequence was aborted)."""
        for slot in sched.write_slots:
            self.slots.decref(slot)
        sched.write_slots = []
