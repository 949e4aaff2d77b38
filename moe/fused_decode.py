"""The sm90-fp8 backend's few-token decode op: Triton gate/up (moe.kernels.triton_fused_decode), then for
one token the CuTeDSL `down` of moe.kernels.sm90_decode_down (its weights arrive by bulk copies into
shared memory, all issued before the PDL wait), else Triton's `down`.

$NVL72_MOE_SM90_DOWN: "1" (default) uses the CuTeDSL down where it applies (one token, no shared
expert, a compiled (k, I) variant in the bundle), "0" keeps Triton's; the choice is logged once per
shape.
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
    token. `module`: the loaded down module (None: Triton's down only)."""

    def __init__(self, module=None):
        self.module = module
        self._logged: set = set()

    def _variant(self, x, topk_ids, w2, shared) -> str | None:
        flag = os.environ.get(ENV, "1")
        if flag not in ("0", "1"):
            raise ValueError(f"${ENV}={flag!r}: expected 0 or 1")
        (t, k), (_, h, inter) = topk_ids.shape, w2.shape
        name = f"down_k{k}_i{inter}"
        why = None
        if flag == "0":
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
        key = (x.device, t, k, inter, why)
        if key not in self._logged:
            self._logged.add(key)
            log.info("moe fused decode, %d token(s), k=%d, I=%d: down %s", t, k, inter,
                     f"in Triton ({why})" if why else f"in CuTeDSL ({name})")
        return None if why else name

    def __call__(self, x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset=0, shared=None,
                 shared_gate=None, shared_ready=None, out=None):
        name = self._variant(x, topk_ids, w2, shared)
        if name is None:
            return tfd.fused_decode(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset, shared,
                                    shared_gate, shared_ready, out)
        act = tfd.gate_up(x, topk_ids, w13, w13_scale, expert_offset)
        h = w2.shape[1]
        out = tfd.out_buffer(out, (1, h), x.dtype, x.device, "out")
        getattr(self.module, name)(act.view(-1), topk_ids.contiguous().view(-1),
                                   topk_weights.float().contiguous().view(-1), w2.view(torch.uint8).view(-1),
                                   w2_scale.contiguous().view(-1), out.view(-1), expert_offset, w2.shape[0], h,
                                   int(pdl_enabled(x.device)))
        return out
