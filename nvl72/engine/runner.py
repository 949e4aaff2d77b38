"""Model runner: turns a scheduler step into one `ForwardBatch`, runs the model, samples.

Prefill chunks, decode tokens and speculative verify rows are flattened into one batch; logits are
computed only for the rows that sample (the last token of a finishing prefill chunk, every
position of a decode step with drafts).
"""
from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from nvl72.engine.sampler import SampleResult, SampleRow, Sampler
from nvl72.engine.scheduler import ScheduledSeq
from nvl72.model.batch import ForwardBatch, ModelCaches
from nvl72.model.dp_ep import MAIN_PASS


@dataclass
class StepResult:
    hidden: torch.Tensor  # [T, H] the model's output for every fed token
    batch: ForwardBatch
    sample_rows: list[tuple[int, int]]  # (index into scheduled, query offset) per sampled row
    sampled: SampleResult | None


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
        input_ids=torch.tensor(ids, dtype=torch.long).to(device),
        positions=torch.tensor(pos, dtype=torch.long).to(device),
        query_start_loc=torch.tensor(cu, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        page_table=table.to(device),
        state_read_slots=torch.tensor([s.seq.state_slot for s in scheduled], dtype=torch.long).to(device)
        if hybrid else None,
        state_write_slots=torch.tensor(write, dtype=torch.long).to(device) if hybrid else None,
        logits_indices=torch.tensor(logits_idx, dtype=torch.long).to(device),
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

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> StepResult:
        if self._graph_fits(scheduled):  # decode step: replay, inputs through pinned staging buffers
            cpu_batch, rows = build_batch(scheduled, self.page_size, self.hybrid, "cpu")
            hidden, batch = self.graphs.run(cpu_batch)
        else:
            batch, rows = build_batch(scheduled, self.page_size, self.hybrid, self.device)
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
        return StepResult(hidden, batch, rows, self.sampler(logits, sample_rows))
