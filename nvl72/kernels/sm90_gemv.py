"""One-token bf16 GEMV (out [N] = W [N, K] @ x [K]) whose CTA holds its whole weight slice in shared memory.

Why: at batch 1 a projection's weight does not depend on the previous kernel, but a Triton GEMV can
keep only its first K tile in registers before its PDL wait. Here each CTA (R rows) asks for all of
its R x K weight bytes by bulk copies into shared memory before `griddepcontrol.wait`, so the stream
runs under the previous kernel (attention for o_proj) and what is left after the wait is staging x and
dot products from shared memory.

CTA: R rows (N / R CTAs; 4 warps, R / 4 rows a warp). Thread 0 asks for the R contiguous rows (R
bulk copies of 2K bytes on one mbarrier); after the wait every thread stages its part of x (bf16 ->
fp32, all loads before the stores), then warp w sums rows w * R / 4 ..., lane l on columns
q * 128 + 4 l (conflict-free 256-byte warp segments), fp32, butterfly sums; lane 0 writes bf16.
Arguments (flat torch views): (x [K] bf16, w [N * K] bf16, out [N] bf16, N, pdl).
"""
import cutlass
import cutlass.cute as cute

from moe.kernels.sm90_one_token import (_fake_args, _shared_storage, _shared_views, bulk_g2s, ld_global_bf16x4,
                                        ld_shared_bf16x4, ld_shared_v4f, st_shared_v4f, warp_sum)

ARCHS = ("sm_90a",)
WARPS = 4
VARIANTS = {"gemv_k4096_r16": dict(k=4096, rows=16), "gemv_k4096_r8": dict(k=4096, rows=8)}  # Qwen3-30B-A3B o_proj
for _r in (8, 16):  # q/k/v with the input norm (and the residual add: _d)
    VARIANTS[f"norm_gemv_k2048_r{_r}"] = dict(k=2048, rows=_r, norm="plain")
    VARIANTS[f"norm_gemv_k2048_r{_r}_d"] = dict(k=2048, rows=_r, norm="delta")


class GemvSmem:
    """One compiled variant: K and the rows a CTA holds (both size the shared memory)."""

    def __init__(self, k: int, rows: int, norm: str | None = None, zero_centered: bool = False):
        self.threads = 32 * WARPS
        if k % (4 * self.threads) or rows % WARPS:
            raise ValueError(f"K={k}, rows={rows}: K must be a multiple of {4 * self.threads}, rows of {WARPS}")
        self.k, self.rows, self.rpw = k, rows, rows // WARPS
        self.norm, self.zc = norm, zero_centered

    @cute.jit
    def __call__(self, x: cute.Tensor, delta: cute.Tensor, norm_w: cute.Tensor, sum_out: cute.Tensor,
                 w: cute.Tensor, out: cute.Tensor, n: cutlass.Int32, eps: cutlass.Float32, pdl: cutlass.Int32,
                 stream):
        self.shared_storage = _shared_storage(self.rows * self.k * 2, self.k, 4)
        self.kernel(x, delta, norm_w, sum_out, w, out, eps).launch(grid=[n // self.rows, 1, 1], block=[self.threads, 1, 1], stream=stream,
                                      use_pdl=pdl)

    @cute.kernel
    def kernel(self, x: cute.Tensor, delta: cute.Tensor, norm_w: cute.Tensor, sum_out: cute.Tensor, w: cute.Tensor,
               out: cute.Tensor, eps: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bar, w_s, x_s, red = _shared_views(self.shared_storage, 4, tidx)
        k, threads, rpw = self.k, self.threads, self.rpw
        n0 = bidx * self.rows
        row_bytes = k * 2
        if tidx == 0:  # the weights are constant: asked for before the wait
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.rows * row_bytes)
            src = w.iterator.toint() + cutlass.Int64(n0) * row_bytes
            for r in cutlass.range_constexpr(self.rows):
                bulk_g2s(w_s + r * row_bytes, src + r * row_bytes, row_bytes, bar.toint())
        steps = k // (4 * threads)
        if cutlass.const_expr(self.norm is not None):
            nw_base = norm_w.iterator.toint()
            nw = [ld_global_bf16x4(nw_base + cutlass.Int64((i * threads + tidx) * 4) * 2) for i in range(steps)]
        cute.arch.griddepcontrol_wait()  # x (the previous kernel's output) is complete and visible
        cute.arch.griddepcontrol_launch_dependents()
        x_base = x.iterator.toint()
        xv = [ld_global_bf16x4(x_base + cutlass.Int64((i * threads + tidx) * 4) * 2) for i in range(steps)]
        if cutlass.const_expr(self.norm is not None):
            xv = self._normed(xv, nw, delta, sum_out, red, eps, bidx, tidx)
        for i in cutlass.range_constexpr(k // (4 * threads)):
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
        """This thread's values of RMSNorm(x (+ delta)), rounded as fused_triton's norm_gemv rounds (the
        sum rounded to bf16 and stored by CTA 0; v * rstd and its product with the weight each rounded,
        or v * rstd * (1 + w) once when zero-centred)."""
        threads, steps = self.threads, self.k // (4 * self.threads)
        if cutlass.const_expr(self.norm == "delta"):
            d_base = delta.iterator.toint()
            dv = [ld_global_bf16x4(d_base + cutlass.Int64((i * threads + tidx) * 4) * 2) for i in range(steps)]
            xv = [[(xv[i][j] + dv[i][j]).to(cutlass.BFloat16).to(cutlass.Float32) for j in range(4)]
                  for i in range(steps)]
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
        rstd = cute.math.rsqrt((red[0] + red[1] + red[2] + red[3]) / self.k + eps)
        if cutlass.const_expr(self.zc):
            return [[(xv[i][j] * rstd * (1.0 + nw[i][j])).to(cutlass.BFloat16).to(cutlass.Float32) for j in range(4)]
                    for i in range(steps)]
        return [[((xv[i][j] * rstd).to(cutlass.BFloat16).to(cutlass.Float32) * nw[i][j]).to(cutlass.BFloat16)
                 .to(cutlass.Float32) for j in range(4)] for i in range(steps)]


# (x, delta, norm_w, sum_out, w, out), then N, eps, pdl
_ARGS = ([(cutlass.BFloat16, 16), (cutlass.BFloat16, 16), (cutlass.BFloat16, 16), (cutlass.BFloat16, 16),
          (cutlass.BFloat16, 16), (cutlass.BFloat16, 2)],)


def compile_for_export(arch: str = "sm_90a") -> dict:
    """{export name: compiled fn} for every entry of VARIANTS (arguments: module docstring)."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch={arch!r}: the GEMV kernels are built for sm_90a")
    opts = f"--gpu-arch {arch} --enable-tvm-ffi"
    fake = _fake_args(*_ARGS[:1], 1)  # the tensors, N, the stream
    args = (*fake[:-1], cutlass.Float32(0.0), cutlass.Int32(0), fake[-1])  # then eps, pdl
    return {name: cute.compile(GemvSmem(**kw), *args, options=opts) for name, kw in VARIANTS.items()}
