"""The one-token MoE layer in one Triton kernel: gate/up, a grid barrier, down. An experiment, off by
default ($NVL72_MOE_ONE_KERNEL=1 turns it on): every form measured slower than the two kernels of
moe.kernels.triton_fused_decode (perf/RESULTS.md, 2026-11-28, H200, 48-layer batch-1 step 2.31 ms
with two kernels; this form 2.48, with PREFETCH 2.56, with the down unit held in registers across
the barrier 2.71 (ptxas spilled it, each load waited for) and as 128 programs of 16 warps holding a
whole row block 2.71).

Why it was tried: as two kernels `down` cannot start streaming its 12.6 MB of w2 (Qwen3-30B-A3B, FP8)
until gate/up's programs leave the SMs, since gate/up fills them (its programs start as gate/up's
end: tests/moe/gpu_moe_timeline.py). In one kernel every program could issue its down unit's loads
first (the routing is all the kernel waits for) so both weights stream together.

Program p of P = (H / BLOCK_N2) x NCH (all resident: three programs of 8 warps per SM, held to
MAX_REGS registers; 384 programs for Qwen3-30B-A3B):
  1. wait for the routing (PDL), read the token's k expert ids; with PREFETCH, `prefetch.global.L1`
     of its down unit's lines (w2[e_slot, rows of block p // NCH, columns of chunk p % NCH]);
  2. gate/up items p, p + P, ... (an item: BLOCK_N rows of one slot's gate and up), their K steps
     one sequence, each tile loaded a step ahead (past L1); act = silu(g) * up in fp32;
  3. grid barrier (aot.grid): every item's act stored and visible;
  4. its down unit: sum over slots of topk_weight * (w2 unit . act columns), a 128-column scale
     block at a time; the last of a row block's NCH programs to finish sums the partials in chunk
     order (deterministic) and writes out (a per-block counter it resets).

Numerics equal triton_fused_decode's (fp32 accumulation on the FP8 weights with their 128 x 128
block scales; no activation quantization). T == 1 and no shared expert only: `supported` says why
not otherwise, and the caller runs the two kernels. Triton's CPU interpreter runs programs one after
another (a barrier would never open), so there the kernel is launched twice, phase 1 (steps 1, 2)
then phase 2 (1, 4); the GPU runs phase 0 (all) unless `phases=True` (an A/B of the barrier).
"""
from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from aot.grid import grid_leave, grid_sync, programs_per_sm
from aot.pdl import launch_args, wait_prior
from moe.kernels.triton_fused_decode import _check, _out
from moe.kernels.triton_fused_decode import fused_decode as two_kernels

log = logging.getLogger(__name__)

ENV = "NVL72_MOE_ONE_KERNEL"  # "1": fused_decode runs this kernel at one token where supported; "0" (default): two
BLOCK_N, BLOCK_K = 16, 256  # gate/up item rows, K step (triton_fused_decode's)
BLOCK_N2 = 16  # output rows of a down unit
CHUNK = 256  # w2 columns of a down unit
NUM_WARPS = 8
# `prefetch.global.L1` of each program's down unit before gate/up (its loads then `.cg`): measured
# slower than without on an H200 (perf/RESULTS.md, 2026-11-28)
PREFETCH = False
MAX_REGS = 80  # three programs per SM (65536 registers, allocated 256 per warp)

_BARRIERS: dict[torch.device, torch.Tensor] = {}
_FIT: dict[tuple, int] = {}
_LOGGED: set = set()


@triton.jit
def _pick(vec, idx, i):
    """vec[i] of a small vector (as a scalar)."""
    return tl.sum(tl.where(idx == i, vec, 0))


@triton.jit
def _slots(ids_ptr, num_local, expert_offset, K: tl.constexpr, KP: tl.constexpr):
    """The token's slots [KP]: local expert index (-1: another rank's, or padding), whether local, and
    the index as int64 (0 where not local)."""
    slot = tl.arange(0, KP)
    e_vec = tl.load(ids_ptr + slot, mask=slot < K, other=-1).to(tl.int32) - expert_offset
    ok = (slot < K) & (e_vec >= 0) & (e_vec < num_local)
    e_vec = tl.where(ok, e_vec, -1)
    return slot, e_vec, ok, tl.maximum(e_vec, 0).to(tl.int64)


@triton.jit
def _gu_tiles(x_ptr, w_ptr, s_ptr, e_vec, slot, item, ks, live, H, I, NB, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """Step (item, ks) of gate/up: its gate and up tiles as [BLOCK_N, BLOCK_K / 128, 128] (a scale
    block per middle index), x at its columns [BLOCK_K / 128, 128] (bf16) and both scales
    [BLOCK_K / 128]; all masked (nothing read) where not `live` or the item's slot has no local
    expert. The scales weigh per-block partial sums, not each element: a [BLOCK_K] fp32 vector per
    thread and step of each was what made ptxas spill."""
    NKB: tl.constexpr = BLOCK_K // 128
    nb_i = item // NB
    e = _pick(e_vec, slot, nb_i)
    n0 = (item % NB) * BLOCK_N
    on = live & (e >= 0)
    e64 = tl.maximum(e, 0).to(tl.int64)
    rows = n0 + tl.arange(0, BLOCK_N)
    kb = ks * NKB + tl.arange(0, NKB)  # scale blocks of this step
    cols = kb[:, None] * 128 + tl.arange(0, 128)[None, :]
    cm = cols < tl.where(on, H, 0)  # (a scalar & a vector mask: int32 under the interpreter)
    g_rows = w_ptr + (e64 * 2 * I + rows[:, None, None]) * H
    g = tl.load(g_rows + cols[None, :, :], mask=cm[None, :, :], other=0.0, cache_modifier=".cg")
    u = tl.load(g_rows + I * H + cols[None, :, :], mask=cm[None, :, :], other=0.0, cache_modifier=".cg")
    sg = s_ptr + (e64 * (2 * I // 128) + n0 // 128) * (H // 128) + kb
    bm = kb < tl.where(on, H // 128, 0)
    x = tl.load(x_ptr + cols, mask=cm, other=0.0)
    return g, u, x, tl.load(sg, mask=bm, other=0.0), tl.load(sg + (I // 128) * (H // 128), mask=bm, other=0.0)


@triton.jit
def _gate_up_items(x_ptr, w_ptr, s_ptr, act_ptr, e_vec, slot, pid, nprog, H, I, K: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[pair, rows] = silu(x . gate) * (x . up) for this program's items (pid, pid + nprog, ...)."""
    NB = I // BLOCK_N
    KS = tl.cdiv(H, BLOCK_K)
    mine = tl.maximum((K * NB - pid + nprog - 1) // nprog, 0)
    total = mine * KS
    g, u, x, sg, su = _gu_tiles(x_ptr, w_ptr, s_ptr, e_vec, slot, pid, 0, total > 0, H, I, NB, BLOCK_N, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for s in range(0, total):
        nxt = s + 1
        g_n, u_n, x_n, sg_n, su_n = _gu_tiles(x_ptr, w_ptr, s_ptr, e_vec, slot, pid + (nxt // KS) * nprog, nxt % KS,
                                              nxt < total, H, I, NB, BLOCK_N, BLOCK_K)
        xf = x.to(tl.float32)[None, :, :]
        acc_g += tl.sum(tl.sum(g.to(tl.float32) * xf, 2) * sg[None, :], 1)
        acc_u += tl.sum(tl.sum(u.to(tl.float32) * xf, 2) * su[None, :], 1)
        if s % KS == KS - 1:
            item = pid + (s // KS) * nprog
            pair = item // NB
            rows = (item % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
            local = _pick(e_vec, slot, pair) >= 0
            act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(act_ptr + pair * I + rows, act, mask=rows < tl.where(local, I, 0))
            acc_g = tl.zeros([BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_N], tl.float32)
        g, u, x, sg, su = g_n, u_n, x_n, sg_n, su_n


@triton.jit
def _w2_prefetch_l1(w_ptr, e64, n0, c, H, I, BLOCK_N2: tl.constexpr, CHUNK: tl.constexpr):
    """`prefetch.global.L1` of every 128-byte line of the down unit (slots without a local expert
    point at expert 0's: a harmless extra line): no registers held, nothing waited for."""
    rows = n0 + tl.arange(0, BLOCK_N2)
    lines = c * (CHUNK // 128) + tl.arange(0, CHUNK // 128)
    a = w_ptr + ((e64 * H)[:, None, None] + rows[None, :, None]) * I + lines[None, None, :] * 128
    tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [a], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _down_unit(w_ptr, act_ptr, s_ptr, tw_ptr, e64, ok, slot, n0, c, H, I, BLOCK_N2: tl.constexpr,
               CHUNK: tl.constexpr):
    """[BLOCK_N2]: sum over slots of topk_weight * (w2[e_slot, rows, chunk c] . act[slot, chunk c]),
    one 128-column scale block at a time ([KP, BLOCK_N2, 128] FP8 and its [KP] scales: a whole
    chunk at once needs ~150 registers a thread); act read past L1 (other programs wrote it)."""
    rows = n0 + tl.arange(0, BLOCK_N2)
    kc = tl.arange(0, 128)
    w_rows = w_ptr + ((e64 * H)[:, None, None] + rows[None, :, None]) * I
    s_row = s_ptr + (e64 * (H // 128) + n0 // 128) * (I // 128)
    acc = tl.zeros([BLOCK_N2], tl.float32)
    tw = tl.load(tw_ptr + slot, mask=ok, other=0.0)
    for j in tl.static_range(CHUNK // 128):
        kb = c * (CHUNK // 128) + j
        wv = tl.load(w_rows + kb * 128 + kc[None, None, :], mask=ok[:, None, None], other=0.0)
        a = tl.load(act_ptr + slot[:, None] * I + kb * 128 + kc[None, :], mask=ok[:, None], other=0.0,
                    cache_modifier=".cg")
        sc = tl.load(s_row + kb, mask=ok, other=0.0)
        acc += tl.sum(tl.sum(wv.to(tl.float32) * a[:, None, :], 2) * (sc * tw)[:, None], 0)
    return acc


@triton.jit
def _combine(part_ptr, cnt_ptr, out_ptr, rb, c, y, H, NCH: tl.constexpr, NCHP: tl.constexpr,
             BLOCK_N2: tl.constexpr):
    """Store this chunk's partial rows; the last of the row block's NCH programs to arrive sums
    them in chunk order (deterministic), writes out and resets the row block's counter."""
    rows = rb * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    if NCH == 1:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(part_ptr + c * H + rows, y)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + rb, 1, sem="acq_rel", scope="gpu") == NCH - 1:
            ch = tl.arange(0, NCHP)
            parts = tl.load(part_ptr + ch[:, None] * H + rows[None, :], mask=(ch < NCH)[:, None], other=0.0,
                            cache_modifier=".cg")
            tl.store(out_ptr + rows, tl.sum(parts, 0).to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(cnt_ptr + rb, 0)


@triton.jit(do_not_specialize_on_alignment=["x_ptr", "ids_ptr", "tw_ptr", "act_ptr", "part_ptr", "out_ptr"])
def _one_token_kernel(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr, act_ptr, part_ptr, out_ptr, bar_ptr,
                      H, I, num_local, expert_offset, K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N2: tl.constexpr, CHUNK: tl.constexpr, NCH: tl.constexpr,
                      NCHP: tl.constexpr, PREFETCH: tl.constexpr, PHASE: tl.constexpr, PDL: tl.constexpr):
    """PHASE 0: gate/up, barrier, down; 1: gate/up only; 2: down only (see the module docstring).
    Program p holds down unit p: rows of block p // NCH, w2 columns of chunk p % NCH."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wait_prior(PDL)
    slot, e_vec, ok, e64 = _slots(ids_ptr, num_local, expert_offset, K, KP)
    rb = pid // NCH
    c = pid % NCH
    if PHASE != 1 and PREFETCH:  # the down unit's lines into this SM's L1, before gate/up's first loads
        _w2_prefetch_l1(w2_ptr, e64, rb * BLOCK_N2, c, H, I, BLOCK_N2, CHUNK)
    if PHASE != 2:
        _gate_up_items(x_ptr, w13_ptr, s13_ptr, act_ptr, e_vec, slot, pid, nprog, H, I, K, BLOCK_N, BLOCK_K)
    if PHASE == 0:
        grid_sync(bar_ptr, nprog)
    if PHASE != 1:  # the slots again: kept from before, they held registers across gate/up (ptxas spilled)
        slot, e_vec, ok, e64 = _slots(ids_ptr, num_local, expert_offset, K, KP)
        y = _down_unit(w2_ptr, act_ptr, s2_ptr, tw_ptr, e64, ok, slot, rb * BLOCK_N2, c, H, I, BLOCK_N2, CHUNK)
        _combine(part_ptr, bar_ptr + 2, out_ptr, rb, c, y, H, NCH, NCHP, BLOCK_N2)
    if PHASE == 0:
        grid_leave(bar_ptr, 2 * nprog)


def enabled() -> bool:
    """$NVL72_MOE_ONE_KERNEL: "1" or "0" (default: every form measured slower than the two kernels)."""
    flag = os.environ.get(ENV, "0")
    if flag not in ("0", "1"):
        raise ValueError(f"${ENV}={flag!r}: expected 0 or 1")
    return flag == "1"


def supported(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
              w2: torch.Tensor, w2_scale: torch.Tensor, shared: torch.Tensor | None = None) -> str | None:
    """Why the one-kernel path cannot run this call, or None. On a GPU the first call per shape
    compiles the kernel to see how many programs an SM holds (the barrier needs all resident)."""
    (t, k), (_, h, inter) = topk_ids.shape, w2.shape
    if t != 1:
        return f"{t} tokens"
    if shared is not None:
        return "a shared expert (its stream joins before down)"
    if inter % CHUNK:
        return f"I={inter}: not a multiple of {CHUNK} (the down units' columns)"
    if h % BLOCK_N2:
        return f"H={h}: not a multiple of {BLOCK_N2}"
    if x.device.type == "cuda":
        key = (x.device, k, h, inter)
        if key not in _FIT:
            kern = _one_token_kernel.warmup(*_args(x, topk_ids, topk_ids.float(), w13, w13_scale, w2, w2_scale, 0, x),
                                            grid=(1,), **_consts(x.device, k, inter, 0))
            kern._init_handles()  # loads the binary: n_regs
            props = torch.cuda.get_device_properties(x.device)
            per_sm = programs_per_sm(kern, NUM_WARPS, props)
            _FIT[key] = per_sm * props.multi_processor_count
            log.info("triton_one_token: H=%d I=%d k=%d: %d programs, %d fit (%d registers, %d spilled)", h, inter, k,
                     _grid(h, inter), _FIT[key], kern.n_regs, kern.n_spills)
        if _grid(h, inter) > _FIT[key]:
            return f"H={h}, I={inter}: {_grid(h, inter)} programs, the SMs hold {_FIT[key]} at once"
    return None


def _grid(h: int, inter: int) -> int:
    return h // BLOCK_N2 * (inter // CHUNK)


def _consts(device: torch.device, k: int, inter: int, phase: int) -> dict:
    nch = inter // CHUNK
    c = dict(K=k, KP=triton.next_power_of_2(k), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_N2=BLOCK_N2, CHUNK=CHUNK,
             NCH=nch, NCHP=triton.next_power_of_2(nch), PREFETCH=PREFETCH and device.type == "cuda", PHASE=phase,
             num_warps=NUM_WARPS, **launch_args(device))
    if device.type == "cuda":
        c["maxnreg"] = MAX_REGS
    return c


def _args(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset, out) -> tuple:
    """The launch's arguments, with new scratch: act [k, I] and the down partials [NCH, H] (fp32)."""
    (_, k), (num_local, h, inter) = topk_ids.shape, w2.shape
    act = torch.empty(k, inter, dtype=torch.float32, device=x.device)
    part = torch.empty(inter // CHUNK, h, dtype=torch.float32, device=x.device)
    return (x.contiguous(), topk_ids.contiguous(), topk_weights.float().contiguous(), w13, w13_scale, w2, w2_scale,
            act, part, out, _barrier(x.device, h // BLOCK_N2), h, inter, num_local, expert_offset)


def _barrier(device: torch.device, row_blocks: int) -> torch.Tensor:
    """[arrivals, error flag, a counter per down row block] of `device`'s launches (at least
    `row_blocks` counters): zero between launches, which one stream orders."""
    bar = _BARRIERS.get(device)
    if bar is None or bar.numel() < 2 + row_blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("triton_one_token: the barrier must be allocated by an eager call before graph capture")
        bar = _BARRIERS[device] = torch.zeros(2 + row_blocks, dtype=torch.int32, device=device)
    return bar


def check_errors() -> None:
    """Raise if a launch's barrier gave up waiting (results wrong). Reads the flags: a host sync."""
    for device, bar in _BARRIERS.items():
        if int(bar[1]):
            raise RuntimeError(f"triton_one_token on {device}: the grid barrier timed out (flag set): results wrong")


def one_token(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
              w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, expert_offset: int = 0,
              out: torch.Tensor | None = None, *, phases: bool | None = None) -> torch.Tensor:
    """triton_fused_decode.fused_decode for one token without a shared expert, as one launch
    (`supported` must hold). phases (default: only under the interpreter): two launches, no barrier."""
    _check(w13, w13_scale, BLOCK_N, 16, "w13")
    _check(w2, w2_scale, BLOCK_N2, 16, "w2")
    (_, k), (num_local, h, inter) = topk_ids.shape, w2.shape
    why = supported(x, topk_ids, w13, w13_scale, w2, w2_scale)
    if why:
        raise ValueError(f"triton_one_token: {why}")
    if x.shape != (1, h) or w13.shape != (num_local, 2 * inter, h):
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}: expected (1, {h}), "
                         f"({num_local}, {2 * inter}, {h})")
    out = _out(out, (1, h), x.dtype, x.device, "out")
    args = _args(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset, out)
    if phases is None:
        phases = os.environ.get("TRITON_INTERPRET") == "1"
    for phase in ((1, 2) if phases else (0,)):
        _one_token_kernel[(_grid(h, inter),)](*args, **_consts(x.device, k, inter, phase))
    return out


def fused_decode(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset=0, shared=None,
                 shared_gate=None, shared_ready=None, out=None):
    """triton_fused_decode.fused_decode's op for the backend: this kernel where `enabled` and
    `supported` (the choice logged once per shape), the two kernels otherwise."""
    if enabled():
        why = supported(x, topk_ids, w13, w13_scale, w2, w2_scale, shared)
        key = (x.device, tuple(topk_ids.shape), tuple(w2.shape), why)
        if key not in _LOGGED:
            _LOGGED.add(key)
            log.info("moe fused decode, %d token(s), w2 %s: %s", x.shape[0], tuple(w2.shape),
                     f"two kernels ({why})" if why else "one kernel (gate/up, grid barrier, down)")
        if why is None:
            return one_token(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset, out)
    return two_kernels(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset, shared, shared_gate,
                       shared_ready, out)
