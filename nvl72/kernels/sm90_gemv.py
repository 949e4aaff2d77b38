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
"""
import cutlass
import cutlass.cute as cute

from aot.build import fake_args
from aot.ptx import bulk_g2s, ld_global_bf16x4, ld_shared_bf16x4, ld_shared_v4f, st_shared_v4f
from aot.rows import shared_storage_type, shared_views, warp_sum

ARCHS = ("sm_90a",)
WARPS = 8  # (4 and 16 measured slower, above)
ROWS = 16  # weight rows a CTA holds (8 measured slower for both projections, above)
# Qwen3-30B-A3B / Qwen3-Next-80B-A3B: o_proj K = 4096, q/k/v (Next: zero-centred norm) K = 2048
VARIANTS = {"gemv_k4096": dict(k=4096)}
for _zc in ("", "_zc"):
    for _d in ("", "_d"):
        VARIANTS[f"norm_gemv_k2048{_zc}{_d}"] = dict(k=2048, norm="delta" if _d else "plain", zero_centered=bool(_zc))


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
        k, threads, rpw = self.k, self.threads, self.rpw
        steps = k // (4 * threads)
        n0 = bidx * self.rows
        row_bytes = k * 2
        if tidx == 0:  # the weights are constant: asked for before the wait
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.rows * row_bytes)
            src = w.iterator.toint() + cutlass.Int64(n0) * row_bytes
            for r in cutlass.range_constexpr(self.rows):
                bulk_g2s(w_s + r * row_bytes, src + r * row_bytes, row_bytes, bar.toint())
        if cutlass.const_expr(self.norm is not None):
            nw_base = norm_w.iterator.toint()
            nw = [ld_global_bf16x4(nw_base + cutlass.Int64((i * threads + tidx) * 4) * 2) for i in range(steps)]
        cute.arch.griddepcontrol_wait()  # x (the previous kernels' output) is complete and visible
        cute.arch.griddepcontrol_launch_dependents()
        x_base = x.iterator.toint()
        xv = [ld_global_bf16x4(x_base + cutlass.Int64((i * threads + tidx) * 4) * 2) for i in range(steps)]
        if cutlass.const_expr(self.norm is not None):
            xv = self._normed(xv, nw, delta, sum_out, red, eps, bidx, tidx)
        for i in cutlass.range_constexpr(steps):
            st_shared_v4f(x_s + (i * threads + tidx) * 16, xv[i])
        cute.arch.sync_threads()
        cute.arch.mbarrier_wait(bar, 0)
        r0 = (tidx // 32) * rpw
        lane = tidx % 32
        acc = [cutlass.Float32(0.0) for _ in range(rpw)]
        for q in cutlass.range_constexpr(k // 128):
            col = q * 128 + lane * 4
            xq = ld_shared_v4f(x_s + col * 4)
            for i in cutlass.range_constexpr(rpw):
                wv = ld_shared_bf16x4(w_s + (r0 + i) * row_bytes + col * 2)
                acc[i] += wv[0] * xq[0] + wv[1] * xq[1] + wv[2] * xq[2] + wv[3] * xq[3]
        for i in cutlass.range_constexpr(rpw):
            y = warp_sum(acc[i])
            if lane == 0:
                out[n0 + r0 + i] = y.to(cutlass.BFloat16)

    @cute.jit
    def _normed(self, xv, nw, delta, sum_out, red, eps: cutlass.Float32, bidx, tidx):
        """This thread's values of RMSNorm(x (+ delta)), rounded as fused_triton's norm_gemv rounds: the
        sum rounded to bf16 (stored by CTA 0); v * rstd and its product with the weight each rounded, or
        v * rstd * (1 + w) rounded once when zero-centred."""
        threads, steps = self.threads, self.k // (4 * self.threads)
        if cutlass.const_expr(self.norm == "delta"):
            d_base = delta.iterator.toint()
            dv = [ld_global_bf16x4(d_base + cutlass.Int64((i * threads + tidx) * 4) * 2) for i in range(steps)]
            xv = [[_bf16(xv[i][j] + dv[i][j]) for j in range(4)] for i in range(steps)]
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
            return [[_bf16(xv[i][j] * rstd * (1.0 + nw[i][j])) for j in range(4)] for i in range(steps)]
        return [[_bf16(_bf16(xv[i][j] * rstd) * nw[i][j]) for j in range(4)] for i in range(steps)]


def _bf16(v):
    """fp32 `v` rounded to bf16 and back (one torch op in bf16)."""
    return v.to(cutlass.BFloat16).to(cutlass.Float32)


# (x, delta, norm_w, sum_out: 8-byte loads / 2-byte stores; w: bulk copies; out), then N, eps, pdl
_TENSORS = [(cutlass.BFloat16, 8), (cutlass.BFloat16, 8), (cutlass.BFloat16, 8), (cutlass.BFloat16, 2),
            (cutlass.BFloat16, 16), (cutlass.BFloat16, 2)]


def compile_for_export(arch: str = "sm_90a") -> dict:
    """{export name: compiled fn} for every entry of VARIANTS (arguments: module docstring)."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch={arch!r}: the GEMV kernels are built for sm_90a")
    opts = f"--gpu-arch {arch} --enable-tvm-ffi"
    *tensors_n, stream = fake_args(_TENSORS, 1)  # the tensors, N, the stream
    args = (*tensors_n, cutlass.Float32(0.0), cutlass.Int32(0), stream)
    return {name: cute.compile(GemvSmem(**kw), *args, options=opts) for name, kw in VARIANTS.items()}
