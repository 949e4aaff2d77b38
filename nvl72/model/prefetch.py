"""Which weights a captured small decode step reads into L2 ahead of time, and when (issue #4).

At batch 1 the attention projections stream their weights from HBM right after stretches in which
HBM idles (q/k norm + RoPE and paged attention before o_proj; the router and the experts' small
kernels before the next layer's q/k/v). `aot.l2_prefetch.L2Prefetcher` forks a prefetch of the
next projection's weight onto a side stream at the start of such a stretch:
  - "o":   o_proj of this layer, forked once the q/k/v GEMV is queued (runs beside attention);
  - "qkv": the next layer's packed q/k/v (a full-attention layer's), forked once this layer's token
           mixer is queued (runs beside the MoE of this layer).
Only inside CUDA-graph capture (the fork and join are graph edges, free at replay; eagerly each
costs host time) and for steps of at most `MAX_TOKENS` tokens.

$NVL72_L2_PREFETCH: "0" off, else a comma list of the targets above; $NVL72_L2_PREFETCH_METHOD:
one of `aot.l2_prefetch.METHODS`; $NVL72_L2_PREFETCH_PROGRAMS: the side kernels' grid.
"""
from __future__ import annotations

import logging
import os

import torch

from nvl72.config import FULL_ATTENTION

log = logging.getLogger(__name__)

ENV, METHOD_ENV, PROGRAMS_ENV = "NVL72_L2_PREFETCH", "NVL72_L2_PREFETCH_METHOD", "NVL72_L2_PREFETCH_PROGRAMS"
TARGETS = ("o", "qkv")
DEFAULT, DEFAULT_METHOD, DEFAULT_PROGRAMS = "0", "hint", 32
MAX_TOKENS = 64


def targets_from_env() -> tuple[str, ...]:
    """The targets $NVL72_L2_PREFETCH names (empty: off); a bad value raises naming it."""
    flag = os.environ.get(ENV, DEFAULT).strip()
    if flag in ("", "0"):
        return ()
    names = tuple(t.strip() for t in flag.split(","))
    bad = [t for t in names if t not in TARGETS]
    if bad:
        raise ValueError(f"${ENV}={flag!r}: unknown target(s) {bad}; expected 0 or a comma list of {', '.join(TARGETS)}")
    return names


class DecodePrefetch:
    """The prefetch schedule of one model's decoder layers. `launcher` has `fork(tensor)` and
    `join()` (an `L2Prefetcher`, or a recorder in the CPU tests)."""

    def __init__(self, layers, targets: tuple[str, ...], launcher):
        self.targets, self.launcher = frozenset(targets), launcher
        # cache index of a layer -> the Attention of the layer after it, when that is a full-attention layer
        self.next_attention = {layer.cache_idx: nxt.self_attn for layer, nxt in zip(layers, layers[1:])
                               if nxt.layer_type == FULL_ATTENTION}

    def after_qkv(self, attn) -> None:
        """The q/k/v GEMV of `attn` is queued: its o_proj weight next."""
        if "o" in self.targets:
            self.launcher.fork(attn.o_proj.weight)

    def after_mixer(self, layer) -> None:
        """`layer`'s token mixer (o_proj last) is queued: the next layer's packed q/k/v if it is a
        full-attention layer, once `packed_qkv` made it (the warm-up forward before capture does)."""
        nxt = self.next_attention.get(layer.cache_idx)
        if "qkv" in self.targets and nxt is not None and nxt.packed_qkv_weight is not None:
            self.launcher.fork(nxt.packed_qkv_weight)

    def join(self) -> None:
        self.launcher.join()


def for_model(layers, device: torch.device) -> DecodePrefetch | None:
    """The environment's schedule for these layers on `device`, or None (off, or not a CUDA device)."""
    targets = targets_from_env()
    if not targets or device.type != "cuda":
        return None
    from aot.l2_prefetch import L2Prefetcher

    method = os.environ.get(METHOD_ENV, DEFAULT_METHOD)
    try:
        programs = int(os.environ.get(PROGRAMS_ENV, DEFAULT_PROGRAMS))
    except ValueError:
        raise ValueError(f"${PROGRAMS_ENV}={os.environ[PROGRAMS_ENV]!r}: expected an integer") from None
    log.info("L2 prefetch in captured decode steps: %s (%s, %d programs)", ",".join(targets), method, programs)
    return DecodePrefetch(layers, targets, L2Prefetcher(device, method, programs))
