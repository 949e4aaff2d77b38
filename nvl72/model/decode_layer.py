"""A Qwen3-MoE decoder layer for one decode token in one persistent Triton kernel (issue #4).

At batch 1 a decoder layer was 14 kernels of a few microseconds each (perf/RESULTS.md, 2026-11-22
16:08Z): launch, block scheduling and the dependent first loads cost more than the ~38 MB of weights
the layer reads. Here a grid of up to CTAS_PER_SM programs per SM runs the layer's six phases,
separated by grid-wide barriers (an arrival counter in global memory; the grid never holds more
programs than the SMs can hold at once, see `grid_size`, so every program is resident):

  1  residual add + RMSNorm (each program norms the row itself: 2 x H values) and the packed q/k/v
     GEMV, rows in blocks over the programs
  2  per (KV head, key split): split-key paged attention with the q/k RMSNorm + RoPE and the K/V
     store inside (`fused_triton.attend_block` with NORM: the same code as the one-token path of
     `norm_rope_paged_attention`), the last split of a KV head combining
  3  o_proj GEMV
  4  residual add + RMSNorm again and the router GEMV
  5  softmax top-k (every program, from the E logits) and the experts' gate/up + SiLU
     (`triton_fused_decode.gate_up_rows`, FP8 weights read directly) per (slot, row block)
  6  down + the weighted sum over the k slots (`triton_fused_decode.down_rows`) per row block

The first weight tile of the GEMV phases (1, 3, 4) is loaded before their barrier (before the PDL
wait for phase 1): constant, so its stream overlaps the previous phase's tail. The layer returns
(residual, MLP output) as `DecoderLayer.forward_residual` does; their sum is the layer's output.

Measured slower than the per-op kernels on an H200 (perf/RESULTS.md, 2026-11-23: 69.0 us a layer
fused, 60.2 phased, 52.8 per-op; the barriers cost more than PDL launches and the phases stream at
20-50% of the bandwidth), hence off by default.

Numerics follow the triton backend's kernels (`fused_triton`): activations rounded to the model
dtype where the references round; experts in fp32 on the FP8 weights (as the fused decode path,
no activation quantization).

`mode`: "fused" launches the kernel once with the barriers; "phased" launches it once per phase
(no barrier: kernel boundaries order the phases) -- what Triton's CPU interpreter runs (it executes
programs one after another, so a grid barrier would never open) and a GPU A/B of the barriers.
Served by `DecoderLayer.forward_residual` for T == 1 when the triton attention backend enables it
($NVL72_DECODE_LAYER) and `unsupported(layer)` is None.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from aot.pdl import launch_args, wait_prior
from moe.kernels.triton_fused_decode import down_rows, gate_up_rows
from moe.kernels.triton_moe import topk_softmax
from nvl72.model.fused_triton import _round, attend_block, decode_splits, rms_norm_row

log = logging.getLogger(__name__)

MODES = ("fused", "phased")
NUM_PHASES = 6
GEMV_TILE = 8192  # elements of a bf16 GEMV weight tile (rows x K step), as fused_triton.gemv_blocks
BN_UP, BK_UP = 16, 512  # gate/up rows per item, K step (as timed in perf/RESULTS.md, 2026-11-23)
BN_DN, BK_DN = 16, 128  # down rows per item, K step
BLOCK_KV = 64  # keys per attention step (paged_attention's for head_dim <= 128)
NUM_WARPS = 8
CTAS_PER_SM = 4  # programs per SM: each keeps its weight tiles in flight, so more of them stream faster
SPIN_LIMIT = tl.constexpr(1 << 24)  # polls of a grid barrier before giving up (seconds; a barrier takes us)


@triton.jit
def _grid_sync(bar, target):
    """Arrive at the grid barrier and wait until `target` arrivals: all programs' earlier stores
    are visible to this program's later loads (release add, acquire polls). Bounded: after
    SPIN_LIMIT polls the program goes on and raises the error flag after the counter (bar + 1),
    which `check_errors` reads: a wrong result instead of a GPU hung forever."""
    tl.debug_barrier()
    cur = tl.atomic_add(bar, 1, sem="acq_rel", scope="gpu") + 1
    polls = 0
    while (cur < target) & (polls < SPIN_LIMIT):
        cur = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
        polls += 1
    if cur < target:
        tl.atomic_xchg(bar + 1, 1)
    tl.debug_barrier()


@triton.jit
def _tile(w, item, kstep, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows [item * BN, +BN) x columns [kstep * BK, +BK) of a row-major [N, K] weight (masked)."""
    rows = item * BN + tl.arange(0, BN)
    cols = kstep * BK + tl.arange(0, BK)
    return tl.load(w + rows[:, None].to(tl.int64) * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                   other=0.0)


@triton.jit
def _gemv_items(w, xr, out, wv, pid, nprog, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):
    """out[rows] = w[rows] . x (rounded to out's dtype) for row blocks pid, pid + nprog, ...; `wv` is
    the first tile (`_tile(w, pid, 0, ...)`, loaded early by the caller). The steps of all the
    program's blocks form one sequence, each step's tile loaded one step ahead, across blocks too."""
    KS: tl.constexpr = (K + BK - 1) // BK
    n_items = (N + BN - 1) // BN
    mine = tl.maximum((n_items - pid + nprog - 1) // nprog, 0)
    acc = tl.zeros([BN], tl.float32)
    for s in range(0, mine * KS):
        item = pid + (s // KS) * nprog
        ks = s % KS
        nxt = s + 1
        w_next = _tile(w, tl.where(nxt < mine * KS, pid + (nxt // KS) * nprog, n_items), nxt % KS, N, K, BN, BK)
        cols = ks * BK + tl.arange(0, BK)
        xv = tl.load(xr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += tl.sum(wv.to(tl.float32) * xv[None, :], 1)
        if ks == KS - 1:
            rows = item * BN + tl.arange(0, BN)
            tl.store(out + rows, acc.to(out.dtype.element_ty), mask=rows < N)
            acc = tl.zeros([BN], tl.float32)
        wv = w_next


@triton.jit
def _add_norm(x, delta, w, eps, H: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DELTA: tl.constexpr,
              ZC: tl.constexpr, DT: tl.constexpr):
    """(round(x + delta), its RMSNorm) [BLOCK_H] fp32, rounded as fused_triton.add_rms_norm rounds."""
    c = tl.arange(0, BLOCK_H)
    ok = c < H
    v = tl.load(x + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        v = _round(v + tl.load(delta + c, mask=ok, other=0.0).to(tl.float32), DT)
    return v, rms_norm_row(v, tl.load(w + c, mask=ok, other=0.0).to(tl.float32), eps, H, ZC, DT)


@triton.jit(do_not_specialize_on_alignment=["x", "delta", "cos", "sin", "slots", "seq_lens", "page_table"])
def _decode_layer_kernel(
        x, delta, res_out, mlp_out,
        ln1, wqkv, qn, kn, wo, ln2, wr, w13, s13, w2, s2,
        cos, sin, kv_cache, slots, seq_lens, page_table,
        hrows, qkv, attn, part_acc, part_ml, o, res1, h2, logits, act, tw, tid, cnt, bar,
        eps, scale, stride_page, stride_kind, stride_head, stride_tok,
        H: tl.constexpr, BLOCK_H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
        R: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
        KP: tl.constexpr, RENORM: tl.constexpr, HAS_DELTA: tl.constexpr, ZC: tl.constexpr,
        PAGE_SIZE: tl.constexpr, NSPLIT: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_KV: tl.constexpr, IEEE: tl.constexpr, BN_QKV: tl.constexpr, BK_QKV: tl.constexpr,
        BN_O: tl.constexpr, BK_O: tl.constexpr, BN_R: tl.constexpr, BK_R: tl.constexpr,
        BN_UP: tl.constexpr, BK_UP: tl.constexpr, BN_DN: tl.constexpr, BK_DN: tl.constexpr,
        PHASE: tl.constexpr, PDL: tl.constexpr):
    """PHASE 0: all six phases with grid barriers between them; 1..6: that phase alone."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DT = res_out.dtype.element_ty
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    hr = hrows + pid * BLOCK_H  # this program's row: the normed input (the GEMVs read it in K steps)
    c = tl.arange(0, BLOCK_H)
    if PHASE == 0 or PHASE == 1:
        wv = _tile(wqkv, pid, 0, NQKV, H, BN_QKV, BK_QKV)
        wait_prior(PDL)
        s, y = _add_norm(x, delta, ln1, eps, H, BLOCK_H, HAS_DELTA, ZC, DT)
        if pid == 0:
            tl.store(res1 + c, s.to(DT), mask=c < H)
        tl.store(hr + c, y.to(DT), mask=c < H)
        tl.debug_barrier()
        _gemv_items(wqkv, hr, qkv, wv, pid, nprog, NQKV, H, BN_QKV, BK_QKV)
        if PHASE == 0:
            _grid_sync(bar, nprog)
    if PHASE == 2:
        wait_prior(PDL)
    if PHASE == 0 or PHASE == 2:
        GROUP: tl.constexpr = HQ // HKV
        seq_len = tl.load(seq_lens)
        for item in range(pid, HKV * NSPLIT, nprog):  # q/k norm, RoPE, the K/V store: attend_block's NORM
            attend_block(qkv, kv_cache, attn, part_acc, part_ml, cnt + item // NSPLIT, 0, 1, seq_len, page_table,
                         item // NSPLIT, HKV, 0, item % NSPLIT, scale, HQ * D, D, HQ * D, D, stride_page, stride_kind,
                         stride_head, stride_tok, GROUP, GROUP_PAD, BLOCK_M, BLOCK_KV, D, PAGE_SIZE, IEEE, NSPLIT,
                         False, True, qkv + HQ * D, qkv + (HQ + HKV) * D, qn, kn, cos, sin, slots, eps, R, ZC)
        wv = _tile(wo, pid, 0, H, HQ * D, BN_O, BK_O)
        if PHASE == 0:
            _grid_sync(bar, 2 * nprog)
    if PHASE == 3:
        wait_prior(PDL)
        wv = _tile(wo, pid, 0, H, HQ * D, BN_O, BK_O)
    if PHASE == 0 or PHASE == 3:
        _gemv_items(wo, attn, o, wv, pid, nprog, H, HQ * D, BN_O, BK_O)
        wv = _tile(wr, pid, 0, E, H, BN_R, BK_R)
        if PHASE == 0:
            _grid_sync(bar, 3 * nprog)
    if PHASE == 4:
        wait_prior(PDL)
        wv = _tile(wr, pid, 0, E, H, BN_R, BK_R)
    if PHASE == 0 or PHASE == 4:
        s, y = _add_norm(res1, o, ln2, eps, H, BLOCK_H, True, ZC, DT)
        if pid == 0:
            tl.store(res_out + c, s.to(DT), mask=c < H)
            tl.store(h2 + c, y.to(DT), mask=c < H)
        tl.store(hr + c, y.to(DT), mask=c < H)
        tl.debug_barrier()
        _gemv_items(wr, hr, logits, wv, pid, nprog, E, H, BN_R, BK_R)
        if PHASE == 0:
            _grid_sync(bar, 4 * nprog)
    if PHASE == 5:
        wait_prior(PDL)
    if PHASE == 0 or PHASE == 5:
        wk, ik = topk_softmax(logits, E, K, KP, BLOCK_E, RENORM)
        kk = tl.arange(0, KP)
        if pid == 0:
            tl.store(tw + kk, wk, mask=kk < K)
            tl.store(tid + kk, ik, mask=kk < K)
        for item in range(pid, K * (I // BN_UP), nprog):
            slot = item // (I // BN_UP)
            n0 = (item % (I // BN_UP)) * BN_UP
            e = tl.sum(tl.where(kk == slot, ik, 0), 0)
            a = gate_up_rows(h2, e, w13, s13, H, I, n0, BN_UP, BK_UP)
            tl.store(act + slot * I + n0 + tl.arange(0, BN_UP), a)
        if PHASE == 0:
            _grid_sync(bar, 5 * nprog)
    if PHASE == 6:
        wait_prior(PDL)
    if PHASE == 0 or PHASE == 6:
        for item in range(pid, H // BN_DN, nprog):
            yv = down_rows(act, tid, tw, w2, s2, 0, item * BN_DN, H, I, E, 0, K, KP, BN_DN, BK_DN, False, PDL)
            tl.store(mlp_out + item * BN_DN + tl.arange(0, BN_DN), yv.to(DT))
        if PHASE == 0:  # the last program out resets the barrier for the next launch
            if tl.atomic_add(bar, 1, sem="acq_rel", scope="gpu") == 6 * nprog - 1:
                tl.atomic_xchg(bar, 0)


def unsupported(layer) -> str | None:
    """Why `layer` (a `DecoderLayer`) cannot run here, or None: a full-attention Qwen3-MoE layer on
    one rank (no TP, no EP, no attention gate or biases, no shared expert) with FP8 expert weights
    in 128 x 128 blocks and dimensions the phases tile."""
    from moe import MoE

    attn = getattr(layer, "self_attn", None)
    if attn is None:
        return "not a full-attention layer"
    mlp = layer.mlp
    if not isinstance(mlp, MoE):
        return "dense MLP"
    if layer.parallel.tp_size > 1 or layer.parallel.dispatch is not None or mlp.ep_size > 1:
        return "tensor or expert parallel"
    if attn.gated or attn.q_proj.bias is not None or attn.o_proj.bias is not None:
        return "gated attention or projection biases"
    if mlp.shared_expert is not None:
        return "shared expert"
    w = mlp.fp8_weights()
    if w is None:
        return f"the MoE backend {mlp.backend_label()} does not keep FP8 expert weights"
    d, h, inter = attn.head_dim, mlp.hidden, mlp.intermediate
    hq, hkv = attn.num_heads, attn.num_kv_heads
    if d & (d - 1) or d < 16 or hq % hkv:
        return f"head_dim {d} / heads {hq}/{hkv} (a power-of-two head_dim >= 16, whole query groups)"
    if h % BN_DN or inter % 128 or h % 128:
        return f"hidden {h} / moe_intermediate {inter} (multiples of 128)"
    return None


def gemv_blocks(n: int, k: int) -> tuple[int, int]:
    """(rows per block, K step) of a phase's GEMV: tiles of GEMV_TILE elements, at most 8 rows."""
    bn = max(1, min(8, GEMV_TILE // triton.next_power_of_2(k)))
    return bn, min(triton.next_power_of_2(k), GEMV_TILE // bn)


_SCRATCH: dict[tuple, dict[str, torch.Tensor]] = {}
_ROWS: dict[tuple, torch.Tensor] = {}
_GRIDS: dict[tuple, int] = {}


def _scratch(device: torch.device, dtype: torch.dtype, dims: tuple) -> dict[str, torch.Tensor]:
    """The kernel's scratch, one set per (device, dims), shared by the layers (launches on one
    stream do not overlap). Counters start at zero; each launch leaves them at zero."""
    key = (device, dtype, dims)
    buf = _SCRATCH.get(key)
    if buf is None:
        _no_capture(device)
        h, hq, hkv, d, e, inter, k, nsplit = dims
        f32 = dict(dtype=torch.float32, device=device)
        act = dict(dtype=dtype, device=device)
        buf = _SCRATCH[key] = dict(
            qkv=torch.empty((hq + 2 * hkv) * d, **act), attn=torch.empty(hq * d, **act),
            part_acc=torch.empty(hq * nsplit * d, **f32), part_ml=torch.empty(hq * nsplit * 2, **f32),
            o=torch.empty(h, **act), res1=torch.empty(h, **act), h2=torch.empty(h, **act),
            logits=torch.empty(e, **act), act=torch.empty(k * inter, **f32), tw=torch.empty(k, **f32),
            tid=torch.empty(k, dtype=torch.int64, device=device),
            cnt=torch.zeros(hkv, dtype=torch.int32, device=device),  # the attention splits' arrivals
            bar=torch.zeros(2, dtype=torch.int32, device=device))  # [arrivals, error flag]
    return buf


def _rows(device: torch.device, dtype: torch.dtype, nprog: int, block_h: int) -> torch.Tensor:
    """[nprog, block_h]: each program's private row (its normed input, then its q heads)."""
    key = (device, dtype, nprog, block_h)
    rows = _ROWS.get(key)
    if rows is None:
        _no_capture(device)
        rows = _ROWS[key] = torch.empty(nprog, block_h, dtype=dtype, device=device)
    return rows


def _no_capture(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("decode_layer: the scratch must be allocated by an eager step before graph capture")


def check_errors() -> None:
    """Raise if a launch's grid barrier gave up waiting (a program not resident: the grid must
    not exceed the SMs the kernel can hold at once). Reads the flags back: a host sync."""
    for (device, *_), buf in _SCRATCH.items():
        if int(buf["bar"][1]):
            raise RuntimeError(f"decode_layer on {device}: a grid barrier timed out (flag set); results are wrong")


def grid_size(device: torch.device, args: tuple, const: dict, phase: int) -> int:
    """Programs of a launch of `phase` (0: all): CTAS_PER_SM per SM, or as many as that compiled
    variant's registers and shared memory let an SM hold at once if fewer (with the barriers every
    program must be resident; alone, a phase's variant needs far fewer registers than all six's);
    3 in the interpreter. Computed once per (device, phase, constexprs), logged."""
    if device.type != "cuda":
        return 3
    key = (device, phase, CTAS_PER_SM, tuple(sorted(const.items())))
    n = _GRIDS.get(key)
    if n is None:
        k = _decode_layer_kernel.warmup(*args, grid=(1,), PHASE=phase, **const)
        k._init_handles()  # loads the binary: n_regs, n_spills
        props = torch.cuda.get_device_properties(device)
        warps = const["num_warps"]
        warp_regs = -(-k.n_regs * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
        fit = min(getattr(props, "regs_per_multiprocessor", 65536) // (warp_regs * warps),
                  props.max_threads_per_multi_processor // (32 * warps),
                  getattr(props, "shared_memory_per_multiprocessor", 233472) // (k.metadata.shared + 1024), 32)
        if fit < 1:
            raise RuntimeError(f"decode_layer: the kernel ({k.n_regs} registers x {32 * warps} threads, "
                               f"{k.metadata.shared} B shared) does not fit an SM")
        n = _GRIDS[key] = min(fit, CTAS_PER_SM) * props.multi_processor_count
        log.info("decode_layer phase %d: %d programs (%d per SM of %d that fit; %d registers, %d spilled, %d B "
                 "shared)", phase, n, min(fit, CTAS_PER_SM), fit, k.n_regs, k.n_spills, k.metadata.shared)
    return n


def run(layer, x: torch.Tensor, delta: torch.Tensor | None, ctx, mode: str = "fused",
        phases: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer.forward_residual(x, delta, ctx)` for one token ([1, H]) in one launch (mode "fused")
    or six ("phased"; `phases`: only those, to time them: tests/runner/gpu_decode_layer_phases.py);
    ctx planned by the triton attention backend (slot mapping, cos/sin)."""
    if mode not in MODES:
        raise ValueError(f"decode_layer mode {mode!r}: expected one of {MODES}")
    if x.shape[0] != 1 or x.dim() != 2:
        raise ValueError(f"decode_layer runs one token; x.shape={tuple(x.shape)}")
    attn, moe = layer.self_attn, layer.mlp
    w = moe.fp8_weights()
    dev = x.device
    h, d, hq, hkv = moe.hidden, attn.head_dim, attn.num_heads, attn.num_kv_heads
    e, inter, k = moe.num_experts, moe.intermediate, moe.top_k
    kv_cache = ctx.caches.kv[attn.cache_idx]
    batch = ctx.batch
    page_size = kv_cache.shape[3]
    nsplit = decode_splits(dev, 1, hkv, batch.page_table.shape[1] * page_size, BLOCK_KV)
    block_h = triton.next_power_of_2(h)
    buf = _scratch(dev, x.dtype, (h, hq, hkv, d, e, inter, k, nsplit))
    res_out = torch.empty_like(x)
    mlp_out = torch.empty_like(x)
    group_pad = triton.next_power_of_2(hq // hkv)
    wqkv, _ = attn.packed_qkv()
    bn_qkv, bk_qkv = gemv_blocks(wqkv.shape[0], h)
    bn_o, bk_o = gemv_blocks(h, hq * d)
    bk_r = gemv_blocks(e, h)[1]

    def args(hrows):
        return (x, x if delta is None else delta, res_out, mlp_out,
                layer.input_layernorm.weight, wqkv, attn.q_norm.weight, attn.k_norm.weight, attn.o_proj.weight,
                layer.post_attention_layernorm.weight, moe.gate.weight, w.w13, w.w13_scale, w.w2, w.w2_scale,
                ctx.cos, ctx.sin, kv_cache, ctx.attn.slot_mapping, batch.seq_lens, batch.page_table, hrows,
                *(buf[n] for n in ("qkv", "attn", "part_acc", "part_ml", "o", "res1", "h2", "logits", "act", "tw",
                                   "tid", "cnt", "bar")),
                layer.input_layernorm.eps, attn.scale, *kv_cache.stride()[:4])

    const = dict(H=h, BLOCK_H=block_h, HQ=hq, HKV=hkv, D=d, R=ctx.cos.shape[1], E=e,
                 BLOCK_E=triton.next_power_of_2(e), I=inter, K=k, KP=triton.next_power_of_2(k),
                 RENORM=moe.norm_topk_prob, HAS_DELTA=delta is not None, ZC=layer.input_layernorm.zero_centered,
                 PAGE_SIZE=page_size, NSPLIT=nsplit, GROUP_PAD=group_pad,
                 BLOCK_M=max(16 // group_pad, 1),
                 BLOCK_KV=BLOCK_KV, IEEE=x.dtype == torch.float32, BN_QKV=bn_qkv, BK_QKV=bk_qkv, BN_O=bn_o,
                 BK_O=bk_o, BN_R=1, BK_R=bk_r, BN_UP=BN_UP, BK_UP=BK_UP, BN_DN=BN_DN, BK_DN=BK_DN,
                 num_warps=NUM_WARPS, **launch_args(dev))
    run_phases = (0,) if mode == "fused" else phases or range(1, NUM_PHASES + 1)
    grids = [grid_size(dev, args(buf["qkv"]), const, p) for p in run_phases]  # (a stand-in for the rows)
    launch = args(_rows(dev, x.dtype, max(grids), block_h))
    for phase, nprog in zip(run_phases, grids):
        _decode_layer_kernel[(nprog,)](*launch, PHASE=phase, **const)
    return res_out, mlp_out
