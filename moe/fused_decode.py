"""The sm90-fp8 backend's few-token decode op: at one token the CuTeDSL kernels of
moe.kernels.sm90_one_token (gate/up, then down; their weights arrive by bulk copies into shared
memory), else Triton's two kernels (moe.kernels.triton_fused_decode). Each CuTeDSL kernel applies on
its own: gate/up at one token with a compiled H variant; down at one token without a shared expert
with a compiled (k, I) variant; the other runs in Triton (their act [k, I] fp32 is the same).

$NVL72_MOE_SM90_ONE_TOKEN: "1" (default) uses the CuTeDSL kernels where they apply, "0" keeps
Triton's; read when the backend is made, the choice logged once per shape.
"""
from __future__ import annotations

import logging
import os

import torch

from aot.launch import pdl_enabled
from moe.kernels import triton_fused_decode as tfd

log = logging.getLogger("moe.backend")

ENV = "NVL72_MOE_SM90_ONE_TOKEN"
MODULE = "moe.kernels.sm90_one_token"
# the module's rows per CTA (not imported from it: it needs CuTeDSL, which GPU hosts lack)
ROWS = 16  # down: output rows
GU_ROWS = 8  # gate/up: rows of I


class FusedDecode:
    """`fused_decode(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset, shared,
    shared_gate, shared_ready, out)` as triton_fused_decode.fused_decode, with the CuTeDSL kernels at
    one token. `module`: the loaded sm90_one_token module (None: Triton only). ${ENV} is read here,
    once (a bad value raises at backend selection, not in a decode step)."""

    def __init__(self, module=None):
        flag = os.environ.get(ENV, "1")
        if flag not in ("0", "1"):
            raise ValueError(f"${ENV}={flag!r}: expected 0 or 1")
        self.module, self.enabled = module, flag == "1"
        self._choice: dict[tuple, tuple[str | None, str | None]] = {}

    def variants(self, x, topk_ids, w2, shared) -> tuple[str | None, str | None]:
        """(gate/up export, down export) for this shape, None where Triton's kernel runs; logged once."""
        (t, k), (_, h, inter) = topk_ids.shape, w2.shape
        key = (x.device, t, k, h, inter, shared is not None)
        if key not in self._choice:
            gu, dn = f"gate_up_h{h}", f"down_k{k}_i{inter}"
            why_gu = self._why_not(t, gu) or (f"I={inter}: not a multiple of {GU_ROWS}" if inter % GU_ROWS else None)
            why_dn = (self._why_not(t, dn) or ("a shared expert" if shared is not None else None)
                      or (f"H={h}: not a multiple of {ROWS}" if h % ROWS else None))
            log.info("moe fused decode, %d token(s), k=%d, H=%d, I=%d: gate/up %s, down %s", t, k, h, inter,
                     f"in Triton ({why_gu})" if why_gu else f"in CuTeDSL ({gu})",
                     f"in Triton ({why_dn})" if why_dn else f"in CuTeDSL ({dn})")
            self._choice[key] = (None if why_gu else gu, None if why_dn else dn)
        return self._choice[key]

    def _why_not(self, t: int, name: str) -> str | None:
        if not self.enabled:
            return f"${ENV}=0"
        if self.module is None:
            return f"no {MODULE} in the kernel bundle"
        if t != 1:
            return f"{t} tokens"
        if not hasattr(self.module, name):
            return f"no variant {name}"
        return None

    def gate_up(self, x, topk_ids, w13, w13_scale, expert_offset=0, name=None, act=None):
        """act [k, I] fp32 (given or new) of gate_up `name` (None: Triton's, any T); rows of other
        ranks' slots are left unwritten, as triton_fused_decode.gate_up."""
        if name is None:
            return tfd.gate_up(x, topk_ids, w13, w13_scale, expert_offset, act)
        _, k, num_local, _, inter, act = tfd.check_gate_up(x, topk_ids, w13, w13_scale, act)
        x = x.contiguous()
        if x.data_ptr() % 8:  # the export reads x 8 bytes a thread
            x = x.clone()
        getattr(self.module, name)(x.view(-1), topk_ids.contiguous().view(-1), w13.view(torch.uint8).view(-1),
                                   w13_scale.contiguous().view(-1), act.view(-1), expert_offset, num_local,
                                   inter, k, int(pdl_enabled(x.device)))
        return act

    def __call__(self, x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset=0, shared=None,
                 shared_gate=None, shared_ready=None, out=None):
        gu, dn = self.variants(x, topk_ids, w2, shared)
        act = self.gate_up(x, topk_ids, w13, w13_scale, expert_offset, gu)  # Triton's when gu is None
        if dn is None:
            return tfd.fused_decode(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset, shared,
                                    shared_gate, shared_ready, out, act=act)
        num_local, h, _ = w2.shape
        out = tfd.out_buffer(out, (1, h), x.dtype, x.device, "out")
        getattr(self.module, dn)(act.view(-1), topk_ids.contiguous().view(-1),
                                 topk_weights.float().contiguous().view(-1), w2.view(torch.uint8).view(-1),
                                 w2_scale.contiguous().view(-1), out.view(-1), expert_offset, num_local, h,
                                 int(pdl_enabled(x.device)))
        return out
