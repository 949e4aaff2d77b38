"""One-token bf16 projections (out [N] = W [N, K] @ x [K]) whose CTAs hold their whole weight slice in
shared memory, asked for before the PDL wait.

Why: at batch 1 a projection's weight does not depend on the kernel before it, but Triton's GEMV
(nvl72.model.fused_triton.gemv) keeps only its first K tile in registers before its wait. Here each
CTA of ROWS rows asks for all of its ROWS x K weight bytes by bulk copies into shared memory first,
so the stream runs under the previous kernel (attention for o_proj, the MoE down for q/k/v) on the
SMs that kernel leaves free; after the wait only x is staged and the dot products read shared
memory. H200, 48-layer Qwen3-30B-A3B batch-1 step, medians of 5 (perf/RESULTS.md): 1.989 ms with
Triton's GEMVs, 1.930-1.944 with o_proj here, 1.842-1.843 with q/k/v here too (8-row CTAs: 1.950-1.951
/ 1.867-1.869), all at 4 warps; 8 warps 1.807-1.812 against 1.851-1.856 for 4, 16 warps 1.884-1.885.

CTA: ROWS rows (N / ROWS CTAs, WARPS warps, ROWS / WARPS rows a warp). Thread 0 asks for the CTA's rows
(one bulk copy of 2K bytes a row, one mbarrier). After the wait every thread loads its part of x
(bf16; with `norm`, x + delta rounded to bf16, stored by CTA 0 as the residual sum, then RMSNorm'd
rounded as fused_triton's norm_gemv rounds: its norm-weight part was loaded before the wait), stores
it to shared memory as fp32, then warp w sums its rows, lane l on columns q * 128 + 4 l (conflict-free
256-byte warp segments), in fp32; butterfly sums, lane 0 writes bf16.

Exports (VARIANTS): gemv_k{K} (plain), norm_gemv_k{K}[_zc][_d] (input RMSNorm, zero-centred weight
(1 + w), residual add). Arguments (flat torch views): (x [K], delta [K], norm_w [K], sum_out [K], w
[N * K], out [N], all bf16; N, eps (fp32), pdl); a plain GEMV ignores delta / norm_w / sum_out / eps,
a norm without delta ignores delta and sum_out.
ATTN_VARIANTS: attn_gemv_k{K}_d{D} (o_proj of a one-token split attention that left the combine of up
to LEAVE splits to it: nvl72.model.fused_triton.paged_attention_partials), (x [K] bf16 (the attention's
out), acc [Hq * splits * D] bf16, ml [Hq * splits * 2] fp32, seq_lens [>= 1] int32, w, out; N, splits,
block_n, pdl): x staged from the partials where 2 to LEAVE splits hold the sequence's keys, from x otherwise.
H200, 48-layer batch-1 step (perf/RESULTS.md): 1.727 -> 1.669 ms against the attention combining
its splits (arrival atomic + partial reload: 2.0 us a layer) at contexts up to 256 keys (LEAVE 4);
LEAVE 8 (in two rounds of STAGE splits) 1.746 -> 1.698 at 128-512 keys, 1.669 -> 1.676 at up to 192.
The partials' reading is what costs: bulk-copied by one warp (64 copies) the step was 1.724, with
fp32 partials 1.718 against 1.724.
"""
import cutlass
import cutlass.cute as cute

from aot.build import fake_args
from aot.ptx import (bulk_g2s, cp_async_16, cp_async_wait_all, ld_global_bf16x4, ld_shared_bf16x4, ld_shared_f32,
                     ld_shared_v4f, st_shared_v4f)
from aot.rows import allocate_with_bar, bf16_round, lanes_reduce, shared_storage_type, shared_views, warp_sum

ARCHS = ("sm_90a",)
WARPS = 8  # (4 and 16 measured slower, above)
ROWS = 16  # weight rows a CTA holds (8 measured slower for both projections, above)
# Qwen3-30B-A3B / Qwen3-Next-80B-A3B: o_proj K = 4096, q/k/v (Next: zero-centred norm) K = 2048
VARIANTS = {"gemv_k4096": dict(k=4096)}
for _zc in ("", "_zc"):
    for _d in ("", "_d"):
        VARIANTS[f"norm_gemv_k2048{_zc}{_d}"] = dict(k=2048, norm="delta" if _d else "plain", zero_centered=bool(_zc))
LEAVE = 8  # partial splits the attn variants combine (4 before: 1.746 -> 1.698 ms at contexts of 128-512 keys)
STAGE = 4  # partial splits staged at a time (32 heads: 32 KB of bf16, so an o_proj CTA fits beside an attention CTA)
# o_proj after 32 heads of 128 (Qwen3-30B-A3B)
ATTN_VARIANTS = {"attn_gemv_k4096_d128": dict(k=4096, head_dim=128)}


class GemvSmem:
    """One compiled variant: K (sizes the shared memory), the rows a CTA holds, the input norm (None,
    "plain", "delta": with the residual add) and whether its weight is zero-centred."""

    def __init__(self, k: int, rows: int = ROWS, norm: str | None = None, zero_centered: bool = False,
                 warps: int = WARPS):
        self.warps = warps
        self.threads = 32 * warps
        if k % (4 * self.threads) or rows % warps or norm not in (None, "plain", "delta"):
            raise ValueError(f"K={k}, rows={rows}, norm={norm!r}: K must be a multiple of {4 * self.threads}, rows "
                             f"of {warps}, norm None, 'plain' or 'delta'")
        self.k, self.rows, self.rpw = k, rows, rows // warps
        self.norm, self.zc = norm, zero_centered

    @cute.jit
    def __call__(self, x: cute.Tensor, delta: cute.Tensor, norm_w: cute.Tensor, sum_out: cute.Tensor,
                 w: cute.Tensor, out: cute.Tensor, n: cutlass.Int32, eps: cutlass.Float32, pdl: cutlass.Int32,
                 stream):
        self.shared_storage = shared_storage_type(self.rows * self.k * 2, self.k, self.warps)
        self.kernel(x, delta, norm_w, sum_out, w, out, eps).launch(
            grid=[n // self.rows, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=pdl)

    @cute.kernel
    def kernel(self, x: cute.Tensor, delta: cute.Tensor, norm_w: cute.Tensor, sum_out: cute.Tensor, w: cute.Tensor,
               out: cute.Tensor, eps: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bar, w_s, x_s, red = shared_views(self.shared_storage, self.warps, tidx)
        self._ask_rows(w, w_s, bar, bidx, tidx)
        if cutlass.const_expr(self.norm is not None):
            nw = self._load_x(norm_w, tidx)
        cute.arch.griddepcontrol_wait()  # x (the previous kernels' output) is complete and visible
        cute.arch.griddepcontrol_launch_dependents()
        xv = self._load_x(x, tidx)
        if cutlass.const_expr(self.norm is not None):
            xv = self._normed(xv, nw, delta, sum_out, red, eps, bidx, tidx)
        self._stage(xv, x_s, tidx)
        self._rows_dot_x(w_s, x_s, bar, out, bidx, tidx)

    @cute.jit
    def _ask_rows(self, w: cute.Tensor, w_s, bar, bidx, tidx):
        """Thread 0 asks for the CTA's weight rows (constant: before the PDL wait) on mbarrier `bar`."""
        row_bytes = self.k * 2
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.rows * row_bytes)
            src = w.iterator.toint() + cutlass.Int64(bidx * self.rows) * row_bytes
            for r in cutlass.range_constexpr(self.rows):
                bulk_g2s(w_s + r * row_bytes, src + r * row_bytes, row_bytes, bar.toint())

    @cute.jit
    def _load_x(self, v: cute.Tensor, tidx):
        """This thread's bf16 values of the K-vector v: 4 at column (i * threads + tidx) * 4 of step i."""
        base, threads = v.iterator.toint(), self.threads
        return [ld_global_bf16x4(base + cutlass.Int64((i * threads + tidx) * 4) * 2)
                for i in range(self.k // (4 * threads))]

    @cute.jit
    def _stage(self, xv, x_s, tidx):
        """This thread's x values (`_load_x`'s columns) into the fp32 vector in shared memory."""
        for i in cutlass.range_constexpr(self.k // (4 * self.threads)):
            st_shared_v4f(x_s + (i * self.threads + tidx) * 16, xv[i])

    @cute.jit
    def _rows_dot_x(self, w_s, x_s, bar, out: cute.Tensor, bidx, tidx):
        """Once x is staged and the rows are in: warp w sums its rows (lane l on columns q * 128 + 4 l),
        lane 0 stores them as bf16."""
        cute.arch.sync_threads()
        cute.arch.mbarrier_wait(bar, 0)
        rpw, row_bytes = self.rpw, self.k * 2
        r0 = (tidx // 32) * rpw
        lane = tidx % 32
        acc = [cutlass.Float32(0.0) for _ in range(rpw)]
        for q in cutlass.range_constexpr(self.k // 128):
            col = q * 128 + lane * 4
            xq = ld_shared_v4f(x_s + col * 4)
            for i in cutlass.range_constexpr(rpw):
                wv = ld_shared_bf16x4(w_s + (r0 + i) * row_bytes + col * 2)
                acc[i] += wv[0] * xq[0] + wv[1] * xq[1] + wv[2] * xq[2] + wv[3] * xq[3]
        for i in cutlass.range_constexpr(rpw):
            y = warp_sum(acc[i])
            if lane == 0:
                out[bidx * self.rows + r0 + i] = y.to(cutlass.BFloat16)

    @cute.jit
    def _normed(self, xv, nw, delta, sum_out, red, eps: cutlass.Float32, bidx, tidx):
        """This thread's values of RMSNorm(x (+ delta)), rounded as fused_triton's norm_gemv rounds: the
        sum rounded to bf16 (stored by CTA 0); v * rstd and its product with the weight each rounded, or
        v * rstd * (1 + w) rounded once when zero-centred."""
        threads, steps = self.threads, self.k // (4 * self.threads)
        if cutlass.const_expr(self.norm == "delta"):
            d_base = delta.iterator.toint()
            dv = [ld_global_bf16x4(d_base + cutlass.Int64((i * threads + tidx) * 4) * 2) for i in range(steps)]
            xv = [[bf16_round(xv[i][j] + dv[i][j]) for j in range(4)] for i in range(steps)]
            if bidx == 0:
                for i in cutlass.range_constexpr(steps):
                    for j in cutlass.range_constexpr(4):
                        sum_out[(i * threads + tidx) * 4 + j] = xv[i][j].to(cutlass.BFloat16)
        ss = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(steps):
            for j in cutlass.range_constexpr(4):
                ss += xv[i][j] * xv[i][j]
        ss = warp_sum(ss)
        if tidx % 32 == 0:
            red[tidx // 32] = ss
        cute.arch.sync_threads()
        total = red[0]
        for i in cutlass.range_constexpr(1, self.warps):
            total += red[i]
        rstd = cute.math.rsqrt(total / self.k + eps)
        if cutlass.const_expr(self.zc):
            return [[bf16_round(xv[i][j] * rstd * (1.0 + nw[i][j])) for j in range(4)] for i in range(steps)]
        return [[bf16_round(bf16_round(xv[i][j] * rstd) * nw[i][j]) for j in range(4)] for i in range(steps)]


class AttnGemvSmem(GemvSmem):
    """o_proj of a one-token split attention that left the combine of 2 to `leave` splits to it
    (ATTN_VARIANTS): x is the attention's out, or the combine of its partials, by the splits that
    hold the sequence's keys, counted from seq_lens (staging, read before the wait) as the attention
    counts them (fused_triton.split_chunk: `splits` of whole `block_n`-key blocks). The partials
    come into shared memory STAGE splits at a time by every thread's cp.async (no register results:
    loads into registers were spread over four round trips by ptxas, which sank them to their uses);
    each round adds its splits' weighted outputs to the fp32 x in shared memory."""

    def __init__(self, k: int, head_dim: int, leave: int = LEAVE, rows: int = ROWS, warps: int = WARPS):
        super().__init__(k, rows, None, False, warps)
        heads, threads = k // max(head_dim, 1), 32 * warps
        if (head_dim % 8 or k % head_dim or leave < 2 or leave & (leave - 1) or leave > 32 or heads * leave % 32
                or heads * leave > threads or heads * min(leave, STAGE) * head_dim // 8 % threads):
            raise ValueError(f"K={k}, head_dim={head_dim}, leave={leave}: head_dim a multiple of 8 dividing K, leave "
                             f"a power of 2 up to 32, heads x leave whole warps of the {threads} threads (a thread "
                             f"a split's weight), a round's 16-byte pieces a multiple of the threads")
        self.head_dim, self.leave, self.heads = head_dim, leave, k // head_dim
        self.stage = min(leave, STAGE)

    @cute.jit
    def __call__(self, x: cute.Tensor, acc: cute.Tensor, ml: cute.Tensor, seq_lens: cute.Tensor, w: cute.Tensor,
                 out: cute.Tensor, n: cutlass.Int32, splits: cutlass.Int32, block_n: cutlass.Int32, pdl: cutlass.Int32,
                 stream):
        heads, leave, stage = self.heads, self.leave, self.stage

        @cute.struct
        class AttnStorage:
            bar: cute.struct.MemRange[cutlass.Int64, 1]  # the weight rows'
            w: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.rows * self.k * 2], 128]
            v: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.k], 128]
            acc: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, heads * stage * self.head_dim], 128]
            ml: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, heads * leave * 2], 16]
            cw: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, heads * leave], 16]  # the splits' weights

        self.shared_storage = AttnStorage
        self.kernel(x, acc, ml, seq_lens, w, out, splits, block_n).launch(
            grid=[n // self.rows, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=pdl)

    @cute.kernel
    def kernel(self, x: cute.Tensor, acc: cute.Tensor, ml: cute.Tensor, seq_lens: cute.Tensor, w: cute.Tensor,
               out: cute.Tensor, splits: cutlass.Int32, bn: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        storage = allocate_with_bar(self.shared_storage, tidx)
        bar = storage.bar.data_ptr()
        w_s, x_s = storage.w.data_ptr().toint(), storage.v.data_ptr().toint()
        acc_s, ml_s = storage.acc.data_ptr().toint(), storage.ml.data_ptr().toint()
        cw_s = storage.cw.get_tensor(cute.make_layout(self.heads * self.leave))
        self._ask_rows(w, w_s, bar, bidx, tidx)
        keys = seq_lens[0]
        chunk = cutlass.max(((keys + splits - 1) // splits + bn - 1) // bn * bn, bn)
        active = cutlass.max((keys + chunk - 1) // chunk, 1)
        cute.arch.griddepcontrol_wait()  # the attention's out or partials are complete and visible
        cute.arch.griddepcontrol_launch_dependents()
        if (active > 1) & (active <= self.leave):
            self._copy_pairs(ml, ml_s, splits, tidx)
            self._copy_round(acc, acc_s, splits, active, 0, tidx)
            self._weights(ml_s, cw_s, active, tidx)
            self._add_round(acc_s, x_s, cw_s, 0, tidx)
            for r in cutlass.range_constexpr(1, self.leave // self.stage):
                if active > r * self.stage:
                    cute.arch.sync_threads()  # every thread's reads of the last round are done
                    self._copy_round(acc, acc_s, splits, active, r * self.stage, tidx)
                    self._add_round(acc_s, x_s, cw_s, r * self.stage, tidx)
            self._round_x(x_s, tidx)
        else:
            self._stage(self._load_x(x, tidx), x_s, tidx)
        self._rows_dot_x(w_s, x_s, bar, out, bidx, tidx)

    @cute.jit
    def _copy_pairs(self, ml: cute.Tensor, ml_s, splits, tidx):
        """The heads' first `leave` (max, sum) pairs (zero-filled from `splits` on) by cp.async, 16
        bytes (two pairs) a thread; complete with the first round's copies."""
        leave = self.leave
        if tidx < self.heads * leave // 2:  # the pairs of splits 2p and 2p + 1
            h, p2 = tidx // (leave // 2), tidx % (leave // 2) * 2
            src = ml.iterator.toint() + cutlass.Int64(h * splits + cutlass.min(p2, splits - 2)) * 8
            cp_async_16(ml_s + tidx * 16, src, cutlass.select_(p2 < splits, 16, 0))

    @cute.jit
    def _copy_round(self, acc: cute.Tensor, acc_s, splits, active, j0, tidx):
        """Every thread copies 16-byte pieces of the heads' partial rows j0 .. j0 + stage - 1 (zero-filled
        from `active` on) by cp.async, then waits for its own and the CTA's. (Lane h of one warp
        bulk-copying head h's rows, 64 copies, was 3.2% slower a batch-1 step: the bulk copies are
        issued one after another.)"""
        d, stage, threads = self.head_dim, self.stage, self.threads
        pieces = d * 2 // 16  # a row's 16-byte pieces
        acc_base = acc.iterator.toint()
        for r in cutlass.range_constexpr(self.heads * stage * pieces // threads):
            q = r * threads + tidx
            h, j = q // (stage * pieces), j0 + q // pieces % stage
            src = acc_base + (cutlass.Int64(h * splits + cutlass.min(j, splits - 1)) * d * 2 + q % pieces * 16)
            cp_async_16(acc_s + q * 16, src, cutlass.select_(j < active, 16, 0))
        cp_async_wait_all()
        cute.arch.sync_threads()

    @cute.jit
    def _weights(self, ml_s, cw_s, active, tidx):
        """Split j's weight in head h's x, c_j / sum_j c_j with c_j = l_j * e^(m_j - max m) over j < active
        (0 past it: a pair past `active` may hold anything, stale or never written), into cw_s[h, j]:
        thread h * leave + j computes it, the head's max and sum by shuffles within its `leave` lanes.
        (Each thread computing its own columns' weights, one exp a split and step in every lane of a
        warp that shares the head, made a batch-1 step 1.692 against 1.676 ms at up to 3 splits.)"""
        leave = self.leave
        if tidx < self.heads * leave:  # (whole warps: leave divides 32)
            j = tidx % leave
            m = cutlass.select_(j < active, ld_shared_f32(ml_s + tidx * 8), -cutlass.Float32.inf)
            top = lanes_reduce(m, leave, cute.arch.fmax)
            c = cutlass.select_(j < active, cute.math.exp(m - top, fastmath=True) * ld_shared_f32(ml_s + tidx * 8 + 4),
                                cutlass.Float32(0.0))
            cw_s[tidx] = c * cute.arch.rcp_approx(lanes_reduce(c, leave, lambda a, b: a + b))
        cute.arch.sync_threads()

    @cute.jit
    def _add_round(self, acc_s, x_s, cw_s, j0, tidx):
        """This thread's x values (fp32, in x_s) plus the staged splits' outputs o_j times their weights
        (the first round stores them); rows past `active` were zero-filled and weigh 0."""
        d, stage, leave = self.head_dim, self.stage, self.leave
        for i in cutlass.range_constexpr(self.k // (4 * self.threads)):
            c = (i * self.threads + tidx) * 4
            h = c // d
            o = [cutlass.Float32(0.0) for _ in range(4)]
            if cutlass.const_expr(j0 > 0):
                o = ld_shared_v4f(x_s + c * 4)
            for jj in cutlass.range_constexpr(stage):
                a = ld_shared_bf16x4(acc_s + ((h * stage + jj) * d + c % d) * 2)
                wj = cw_s[h * leave + j0 + jj]
                o = [o[e] + a[e] * wj for e in range(4)]
            st_shared_v4f(x_s + c * 4, o)

    @cute.jit
    def _round_x(self, x_s, tidx):
        """This thread's combined x values rounded to bf16 in place, as the attention rounds its out."""
        for i in cutlass.range_constexpr(self.k // (4 * self.threads)):
            c = (i * self.threads + tidx) * 4
            o = ld_shared_v4f(x_s + c * 4)
            st_shared_v4f(x_s + c * 4, [bf16_round(o[e]) for e in range(4)])


# (x, delta, norm_w, sum_out: 8-byte loads / 2-byte stores; w: bulk copies; out), then N, eps, pdl
_TENSORS = [(cutlass.BFloat16, 8), (cutlass.BFloat16, 8), (cutlass.BFloat16, 8), (cutlass.BFloat16, 2),
            (cutlass.BFloat16, 16), (cutlass.BFloat16, 2)]


# (x: 8-byte loads; acc, ml: 16-byte cp.async; seq_lens; w: bulk copies; out), then N, splits, block_n, pdl
_ATTN_TENSORS = [(cutlass.BFloat16, 8), (cutlass.BFloat16, 16), (cutlass.Float32, 16), (cutlass.Int32, 4),
                 (cutlass.BFloat16, 16), (cutlass.BFloat16, 2)]


def compile_for_export(arch: str = "sm_90a") -> dict:
    """{export name: compiled fn} for every entry of VARIANTS and ATTN_VARIANTS (arguments: module docstring)."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch={arch!r}: the GEMV kernels are built for sm_90a")
    opts = f"--gpu-arch {arch} --enable-tvm-ffi"
    *tensors_n, stream = fake_args(_TENSORS, 1)  # the tensors, N, the stream
    args = (*tensors_n, cutlass.Float32(0.0), cutlass.Int32(0), stream)
    fns = {name: cute.compile(GemvSmem(**kw), *args, options=opts) for name, kw in VARIANTS.items()}
    attn_args = fake_args(_ATTN_TENSORS, 4)  # the tensors, N, splits, block_n, pdl, the stream
    fns.update({name: cute.compile(AttnGemvSmem(**kw), *attn_args, options=opts) for name, kw in ATTN_VARIANTS.items()})
    return fns
