"""Batched token sampler (torch): penalties, temperature, min-p, top-k, top-p, seeded sampling.

Order of operations (each row its own parameters): raw logprobs are taken from the model's logits
(as vLLM reports them); then repetition penalty (HF convention: divide positive logits, multiply
negative ones, over prompt and output tokens), frequency/presence penalties (OpenAI convention,
over output tokens); greedy rows take the argmax; the others are divided by their temperature,
masked by min-p (relative to the top probability), top-k and top-p (smallest set whose mass
reaches p, the top token always kept), and sampled with the row's own `torch.Generator` by the
exponential race `argmax(p / q), q ~ Exp(1)` (one draw per row, so a seed reproduces a stream
whatever the batch around it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nvl72.engine.protocol import SamplingParams
from nvl72.engine.staging import HostRing


@dataclass
class SampleRow:
    params: SamplingParams
    history: list[int]  # prompt then generated tokens (read only when a penalty is set)
    num_prompt: int
    generator: torch.Generator | None = None  # required unless greedy
    extra: list[int] = field(default_factory=list)  # draft tokens before this position (count as generated)

    @property
    def output_ids(self) -> list[int]:
        return self.history[self.num_prompt:] + self.extra


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # chosen tokens' logprobs (raw model distribution), None: none wanted
    top_logprobs: list[list[tuple[int, float]]] | None


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Penalised copy of `logits` [N, V]."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(r.history + r.extra, dtype=torch.long, device=logits.device)
            mask = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            mask[seen] = True
            row = out[i]
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            out[i] = torch.where(mask, pen, row)
        out_ids = r.output_ids if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 else []
        if out_ids:
            counts = torch.bincount(torch.tensor(out_ids, dtype=torch.long, device=logits.device),
                                    minlength=vocab)[:vocab].to(out.dtype)
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits [N, V] with min-p, top-k (<=0: off) and top-p masks as -inf."""
    x = logits / temperature[:, None]
    probs = x.softmax(-1)
    x = x.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    sorted_x, order = x.sort(-1, descending=True)
    vocab = x.shape[1]
    rank = torch.arange(vocab, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)
    sorted_x = sorted_x.masked_fill(rank >= k[:, None], float("-inf"))
    sp = sorted_x.softmax(-1)
    before = sp.cumsum(-1) - sp  # mass strictly before each sorted token
    sorted_x = sorted_x.masked_fill((before >= top_p[:, None]) & (rank > 0), float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


class DeviceSample:
    """A step's sampled tokens (and wanted logprobs) as tensors, before any read-back: async
    scheduling feeds `token_ids` to the next step on the device and reads them one step later."""

    def __init__(self, token_ids: torch.Tensor, want_lp: list[int | None], chosen: torch.Tensor | None = None,
                 top_ids: torch.Tensor | None = None, top_vals: torch.Tensor | None = None):
        self.token_ids, self.want_lp, self.chosen, self.top_ids, self.top_vals = token_ids, want_lp, chosen, top_ids, top_vals
        self.event = None
        self._ring = self._ticket = self._result = None

    def _tensors(self) -> list[torch.Tensor | None]:
        return [self.token_ids, self.chosen, self.top_ids, self.top_vals]

    def copy_to_host(self, ring: HostRing | None = None) -> "DeviceSample":
        """Start non-blocking copies into host memory (CUDA): a buffer of `ring` (reused; the
        sample must be read before the ring hands it out again) or fresh pinned tensors; `result()`
        of the returned sample waits for them alone. On a CPU the tensors are already host tensors."""
        if not self.token_ids.is_cuda:
            return self
        ts = self._tensors()
        if ring is None:
            host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in ts]
        else:
            sizes = [0 if t is None else -(-t.numel() * t.element_size() // 8) * 8 for t in ts]
            buf, off, host = ring.take(sum(sizes)), 0, []
            for t, n in zip(ts, sizes):
                host.append(None if t is None else buf[off:off + n].view(t.dtype)[:t.numel()].view(t.shape))
                off += n
        for h, t in zip(host, ts):
            if t is not None:
                h.copy_(t, non_blocking=True)
        out = DeviceSample(host[0], self.want_lp, *host[1:])
        if ring is None:
            out.event = torch.cuda.Event()
            out.event.record()
        else:
            out._ring, out._ticket = ring, ring.ticket()
            out.event = ring.fence()
        return out

    def result(self) -> SampleResult:
        """The sample on the host (read once: later calls return the same object)."""
        if self._result is not None:
            return self._result
        if self.event is not None:
            self.event.synchronize()
        if self._ring is not None and not self._ring.valid(self._ticket):
            raise RuntimeError("DeviceSample.result(): its host buffer was handed out again before it was read")
        token_list = self.token_ids.tolist()
        if self.chosen is None:
            self._result = SampleResult(token_list, None, None)
            return self._result
        top: list[list[tuple[int, float]]] = []
        for i, n in enumerate(self.want_lp):
            top.append([] if not n else list(zip(self.top_ids[i, :n].tolist(), self.top_vals[i, :n].tolist())))
        self._result = SampleResult(token_list, self.chosen.tolist(), top)
        return self._result


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], greedy: torch.Tensor | None = None
                 ) -> SampleResult:
        """Pick one token per row of `logits` [N, V], read back to the host."""
        return self.sample(logits, rows, greedy).result()

    def sample(self, logits: torch.Tensor, rows: list[SampleRow], greedy: torch.Tensor | None = None
               ) -> DeviceSample:
        """Pick one token per row of `logits` [N, V] (fp32 or the model's dtype) without reading
        anything back. `greedy`: logits.argmax(-1) already computed (the decode graphs do), used
        when every row is plain greedy."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(rows)} sample rows")
        want_lp = [r.params.logprobs for r in rows]
        if all(r.params.greedy and not has_penalty(r.params) and r.params.logprobs is None for r in rows):
            # the argmax of the model's dtype is the argmax of its exact fp32 upcast (ties: the first
            # index either way), without a converted copy of the logits
            return DeviceSample(logits.argmax(-1) if greedy is None else greedy, want_lp)
        logits = logits.float()
        raw_lp = logits.log_softmax(-1) if any(n is not None for n in want_lp) else None
        x = apply_penalties(logits, rows) if any(has_penalty(r.params) for r in rows) else logits
        tokens = x.argmax(-1)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if rand:
            idx = torch.tensor(rand, device=x.device)
            ps = [rows[i].params for i in rand]
            dev = x.device
            filt = filter_logits(
                x[idx],
                torch.tensor([p.temperature for p in ps], dtype=x.dtype, device=dev),
                torch.tensor([p.top_k for p in ps], device=dev),
                torch.tensor([p.top_p for p in ps], dtype=x.dtype, device=dev),
                torch.tensor([p.min_p for p in ps], dtype=x.dtype, device=dev))
            probs = filt.softmax(-1)
            q = torch.empty_like(probs)
            for j, i in enumerate(rand):
                if rows[i].generator is None:
                    raise ValueError(f"sample row {i} (temperature {rows[i].params.temperature}) has no generator")
                q[j].exponential_(generator=rows[i].generator)
            tokens[idx] = (probs / q).argmax(-1)
        if raw_lp is None:
            return DeviceSample(tokens, want_lp)
        chosen = raw_lp.gather(1, tokens[:, None])[:, 0]
        nmax = max((n or 0) for n in want_lp)
        vals, ids = raw_lp.topk(min(nmax, raw_lp.shape[1]), -1) if nmax > 0 else (None, None)
        return DeviceSample(tokens, want_lp, chosen, ids, vals)


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
