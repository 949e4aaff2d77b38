"""Model runner: turns a scheduler step into one `ForwardBatch`, runs the model, samples.

Prefill chunks, decode tokens and speculative verify rows are flattened into one batch; logits are
computed only for the rows that sample (the last token of a finishing prefill chunk, every
position of a decode step with drafts).
"""
from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from nvl72.engine.sampler import DeviceSample, SampleResult, SampleRow, Sampler
from nvl72.engine.scheduler import ScheduledSeq
from nvl72.engine.sequence import Sequence
from nvl72.model.batch import ForwardBatch, ModelCaches
from nvl72.model.dp_ep import MAIN_PASS


@dataclass
class StepResult:
    hidden: torch.Tensor  # [T, H] the model's output for every fed token
    batch: ForwardBatch
    sample_rows: list[tuple[int, int]]  # (index into scheduled, query offset) per sampled row
    sampled: SampleResult | None  # read back (None without sampled rows or when `readback=False`)
    pending: DeviceSample | None = None  # `readback=False`: the tokens, being copied to the host


@dataclass
class PriorTokens:
    """Async scheduling: the tokens of the step still in flight, on the device, and the row of
    each sequence whose last token (a placeholder in `all_ids`) is one of them."""

    token_ids: torch.Tensor
    rows: dict[Sequence, int]


def placeholder_fill(scheduled: list[ScheduledSeq], prior: PriorTokens | None) -> list[list[int]]:
    """[[input position...], [row of `prior`...]]: where the step feeds a token not yet read back."""
    dst: list[int] = []
    src: list[int] = []
    start = 0
    for s in scheduled:
        if s.seq.pending and s.samples:  # the fed range reaches the placeholder, the last known token
            if prior is None or s.seq not in prior.rows:
                raise RuntimeError(f"{s.seq.request_id}: placeholder token with no step in flight sampling it")
            dst.append(start + s.num_new - len(s.drafts) - 1)
            src.append(prior.rows[s.seq])
        start += s.num_new
    return [dst, src]


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, non-blocking (a pageable copy
    would wait for the work in flight: async scheduling's previous step)."""
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def build_batch(scheduled: list[ScheduledSeq], page_size: int, hybrid: bool, device) -> tuple[ForwardBatch, list[tuple[int, int]]]:
    """Flatten the step's sequences into a `ForwardBatch` (built on CPU, moved once)."""
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    write: list[int] = []
    logits_idx: list[int] = []
    rows: list[tuple[int, int]] = []
    max_pages = 1
    for i, s in enumerate(scheduled):
        seq = s.seq
        known = s.num_new - len(s.drafts)
        ids.extend(seq.all_ids[seq.num_computed:seq.num_computed + known])
        ids.extend(s.drafts)
        start = seq.num_computed
        pos.extend(range(start, start + s.num_new))
        seq_lens.append(start + s.num_new)
        max_pages = max(max_pages, len(seq.pages))
        if hybrid:
            w = [-1] * s.num_new
            for off, slot in zip(s.write_offsets, s.write_slots):
                w[off] = slot
            write.extend(w)
        if s.samples:
            first = s.num_new - 1 - len(s.drafts)
            for off in range(first, s.num_new):
                logits_idx.append(cu[-1] + off)
                rows.append((i, off))
        cu.append(cu[-1] + s.num_new)
    flat = array.array("i")  # all page ids back to back: one C-level copy into a tensor
    for s in scheduled:
        flat.extend(s.seq.pages)
    npages = torch.tensor([len(s.seq.pages) for s in scheduled])
    table = torch.full((len(scheduled), max_pages), -1, dtype=torch.int32)  # [B, max_pages]
    table[torch.arange(max_pages)[None, :] < npages[:, None]] = torch.frombuffer(flat, dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=to_device(torch.tensor(ids, dtype=torch.long), device),
        positions=to_device(torch.tensor(pos, dtype=torch.long), device),
        query_start_loc=to_device(torch.tensor(cu, dtype=torch.int32), device),
        seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
        page_table=to_device(table, device),
        state_read_slots=to_device(torch.tensor([s.seq.state_slot for s in scheduled], dtype=torch.long), device)
        if hybrid else None,
        state_write_slots=to_device(torch.tensor(write, dtype=torch.long), device) if hybrid else None,
        logits_indices=to_device(torch.tensor(logits_idx, dtype=torch.long), device),
        max_query_len=max((s.num_new for s in scheduled), default=0),
    )
    return batch, rows


class ModelRunner:
    def __init__(self, model, caches: ModelCaches, page_size: int, hybrid: bool, device):
        self.model = model
        self.caches = caches
        self.page_size = page_size
        self.hybrid = hybrid
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.graphs = None  # nvl72.engine.cuda_graphs.DecodeGraphs when the engine captured them
        self.sync = None  # a DP+EP rank's nvl72.model.dp_ep.PassSync: its forwards in lockstep with the EP group

    def _graph_fits(self, scheduled: list[ScheduledSeq]) -> bool:
        g = self.graphs
        return (g is not None and all(s.num_new == g.query_len for s in scheduled)
                and g.fits(len(scheduled), len(scheduled) * g.query_len, max(len(s.seq.pages) for s in scheduled)))

    def _patch(self, input_ids: torch.Tensor, fill: list[list[int]], prior: PriorTokens) -> None:
        """input_ids[dst] = prior tokens[src], on the device (one pinned non-blocking copy of the indices)."""
        idx = to_device(torch.tensor(fill, dtype=torch.long), input_ids.device)
        input_ids[idx[0]] = prior.token_ids[idx[1]]

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], prior: PriorTokens | None = None, readback: bool = True) -> StepResult:
        """One forward + sampling. `prior`: the step in flight whose tokens this one feeds (async
        scheduling); `readback=False`: the sampled tokens stay on the device (`StepResult.pending`)."""
        fill = placeholder_fill(scheduled, prior)
        patch = (lambda ids: self._patch(ids, fill, prior)) if fill[0] else None
        if self._graph_fits(scheduled):  # decode step: replay, inputs through pinned staging buffers
            cpu_batch, rows = build_batch(scheduled, self.page_size, self.hybrid, "cpu")
            hidden, batch = self.graphs.run(cpu_batch, patch)
        else:
            batch, rows = build_batch(scheduled, self.page_size, self.hybrid, self.device)
            if patch is not None:
                patch(batch.input_ids)
            if self.sync is not None:
                self.sync.before(MAIN_PASS)
            hidden = self.model(batch, self.caches)
        if not rows:
            return StepResult(hidden, batch, rows, None)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sample_rows = []
        for i, off in rows:
            s = scheduled[i]
            first = s.num_new - 1 - len(s.drafts)
            seq = s.seq
            # Penalties at draft position j see the drafts before it as already generated.
            sample_rows.append(SampleRow(seq.params, seq.all_ids, seq.num_prompt, seq.generator,
                                         s.drafts[:off - first]))
        if readback:
            return StepResult(hidden, batch, rows, self.sampler(logits, sample_rows))
        sample = self.sampler.sample(logits, sample_rows)
        return StepResult(hidden, batch, rows, None, sample)
