"""The sm90-fp8 backend's few-token decode op: Triton gate/up (moe.kernels.triton_fused_decode), then for
one token the CuTeDSL `down` of moe.kernels.sm90_decode_down (its weights arrive by bulk copies into
shared memory, all issued before the PDL wait), else Triton's `down`.

$NVL72_MOE_SM90_DOWN: "1" (default) uses the CuTeDSL down where it applies (one token, no shared
expert, a compiled (k, I) variant in the bundle), "0" keeps Triton's; read when the backend is made,
the choice logged once per shape.
"""
from __future__ import annotations

import logging
import os

import torch

from aot.launch import pdl_enabled
from moe.kernels import triton_fused_decode as tfd

log = logging.getLogger("moe.backend")

ENV = "NVL72_MOE_SM90_DOWN"
MODULE = "moe.kernels.sm90_decode_down"
ROWS = 16  # the module's output rows per CTA (not imported from it: it needs CuTeDSL, GPU hosts lack it)


class FusedDecode:
    """`fused_decode(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset, shared,
    shared_gate, shared_ready, out)` as triton_fused_decode.fused_decode, with the CuTeDSL down at one
    token. `module`: the loaded down module (None: Triton's down only). ${ENV} is read here, once (a
    bad value raises at backend selection, not in a decode step); the choice per shape is made and
    logged on its first call."""

    def __init__(self, module=None):
        flag = os.environ.get(ENV, "1")
        if flag not in ("0", "1"):
            raise ValueError(f"${ENV}={flag!r}: expected 0 or 1")
        self.module, self.enabled = module, flag == "1"
        self._choice: dict[tuple, str | None] = {}

    def _variant(self, x, topk_ids, w2, shared) -> str | None:
        (t, k), (_, h, inter) = topk_ids.shape, w2.shape
        key = (x.device, t, k, h, inter, shared is not None)
        if key in self._choice:
            return self._choice[key]
        name = f"down_k{k}_i{inter}"
        why = None
        if not self.enabled:
            why = f"${ENV}=0"
        elif self.module is None:
            why = f"no {MODULE} in the kernel bundle"
        elif t != 1:
            why = f"{t} tokens"
        elif shared is not None:
            why = "a shared expert"
        elif not hasattr(self.module, name):
            why = f"no variant {name}"
        elif h % ROWS:
            why = f"H={h}: not a multiple of {ROWS}"
        log.info("moe fused decode, %d token(s), k=%d, I=%d: down %s", t, k, inter,
                 f"in Triton ({why})" if why else f"in CuTeDSL ({name})")
        self._choice[key] = None if why else name
        return self._choice[key]

    def __call__(self, x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset=0, shared=None,
                 shared_gate=None, shared_ready=None, out=None):
        name = self._variant(x, topk_ids, w2, shared)
        if name is None:
            return tfd.fused_decode(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset, shared,
                                    shared_gate, shared_ready, out)
        act = tfd.gate_up(x, topk_ids, w13, w13_scale, expert_offset)
        num_local, h, _ = w2.shape
        out = tfd.out_buffer(out, (1, h), x.dtype, x.device, "out")
        getattr(self.module, name)(act.view(-1), topk_ids.contiguous().view(-1),
                                   topk_weights.float().contiguous().view(-1), w2.view(torch.uint8).view(-1),
                                   w2_scale.contiguous().view(-1), out.view(-1), expert_offset, num_local, h,
                                   int(pdl_enabled(x.device)))
        return out
