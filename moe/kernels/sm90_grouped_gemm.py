"""Hopper (sm_90a) grouped GEMM for the MoE experts, in CuTeDSL: TMA loads, wgmma, TMA store.

C[rows of expert e] = A[rows of expert e] @ B[e]^T, with B the expert weights as stored ([E, N, K],
K-major: w13 [E, 2I, H] or w2 [E, H, I]). One CTA computes a 128 x 128 tile of C with two
consumer warpgroups (64 rows each); warp 0 also issues the TMA loads of an `ab_stage`-deep
shared-memory ring (the structure of CUTLASS's Hopper dense GEMM example, written for our layouts).

Layouts (see moe/routing.py):
  * contiguous: A [M, K] (each expert's rows padded to a multiple of 128), C [M, N];
    `aux` = tile_expert [M / 128] int32 names the expert of each M tile (-1: skip the tile).
  * masked: A [E, cap, K], C [E, cap, N]; `aux` = counts [E] int32; tiles at or past counts[e]
    are skipped (their rows of C are left as they were).

FP8 (e4m3) operands: Hopper's wgmma has no block scales, so the 1 x 32 MXFP8 scales are regrouped
exactly into power-of-two scales per (row, 128-wide K block) for A and per (128 x 128 block) for B
(moe.mxfp8.regroup_pow2; error documented there). Each 128-wide K tile is accumulated by wgmma
into a temporary fp32 fragment, which is then added into the main accumulator times
sa[row, k] * sb[n_block, k] ("promotion" once per K tile, as DeepGEMM does).
  a_scale: [L, K/128, M] fp32 (contiguous: L = 1, masked: L = E, M = cap)
  b_scale: [E, N/128, K/128] fp32
BF16 operands take the same entry point with the scale arguments ignored (pass 1-element tensors).
Arguments of every export: (a, b, c, a_scale, b_scale, aux[, clusters], pdl); pdl = 1 launches it
with programmatic dependent launch (`aot.launch.pdl_enabled`; `pdl_wait` is every kernel's first step).

Measured on an H200 (perf/RESULTS.md, 2026-11-21): all variants match the fp32 product of the
dequantized operands (rel err < 1e-2). FP8 two-GEMM expert time at 16384 tokens: 9.9 ms for
Qwen3-235B (0.90x torch._scaled_grouped_mm row-wise, 0.83x torch._grouped_mm bf16) and 10.2 ms for
Qwen3.5-397B (1.07x, 1.04x); decode at 128 tokens (swap-AB) at 56% of the copy bandwidth. The
overlapped promotion did not pay (it was slower at most sizes): ptxas serializes its wgmmas (warning
C7514: the wait inside the K loop depends on a branch, so ptxas cannot tell which temporary it
retires); moe/kernels/sm90_grouped_gemm_ws.py has the branch-free form, warp specialization and a
persistent tile walk.

Torch view convention at call time (what `compile_for_export` compiles against): every operand is
passed as a rank-3 view (rows, K or N, batch) = t.permute(1, 2, 0) of the [batch, rows, cols]
tensor; FP8 tensors travel as torch.uint8 views and are re-typed inside the kernel.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

SCALE_BLOCK = 128
ARCHS = ("sm_90a",)  # for aot.build: wgmma exists on Hopper only


class GroupedGemmSm90:
    """One compiled variant: (fp8 with block scales | bf16) x (contiguous | masked) x options.

    swap_ab (masked fp8 only, for decode): computes C^T = B[e] . A^T with the weights as the
      wgmma M operand (64 weight rows per CTA) and the few tokens of an expert as its N operand
      (32 per CTA), so a small batch does not pad every expert to 128 rows of MMA work.
    overlap (fp8): two temporary accumulators, so the promotion of K tile t overlaps the wgmma of
      K tile t+1 (wgmma.wait_group 1 instead of 0).
    """

    def __init__(self, fp8: bool, masked: bool, swap_ab: bool = False, overlap: bool = False):
        if swap_ab and not (fp8 and masked):
            raise ValueError(f"swap_ab={swap_ab} needs fp8 and the masked layout")
        self.fp8, self.masked, self.swap_ab, self.overlap = fp8, masked, swap_ab, overlap and fp8
        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cutlass.Float8E4M3FN if fp8 else cutlass.BFloat16
        self.c_dtype = cutlass.BFloat16
        if swap_ab:
            self.tile_m, self.tile_n, self.n_wg = 64, 32, 1
        else:
            self.tile_m, self.tile_n, self.n_wg = 128, 128, 2  # two consumer warpgroups, 64 rows each
        self.threads = 128 * self.n_wg
        self.c_layout = utils.LayoutEnum.COL_MAJOR if swap_ab else utils.LayoutEnum.ROW_MAJOR
        self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")

    def _setup(self):
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            (self.n_wg, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        inst_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        self.tile_mnk = (self.tile_m, self.tile_n, inst_k * 4)  # fp8: K tile 128 = one scale block
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(
            self.tile_mnk, self.c_dtype, is_cooperative=self.n_wg == 2
        )
        stage_bytes = (self.tile_m + self.tile_n) * self.tile_mnk[2] * self.ab_dtype.width // 8
        self.ab_stage = min(8, (self.smem_capacity - 2048) // stage_bytes)
        self.epi_stage = 4
        k_major = utils.LayoutEnum.ROW_MAJOR
        self.a_smem_staged = sm90_utils.make_smem_layout_a(k_major, self.tile_mnk, self.ab_dtype, self.ab_stage)
        self.b_smem_staged = sm90_utils.make_smem_layout_b(k_major, self.tile_mnk, self.ab_dtype, self.ab_stage)
        self.epi_smem_staged = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage
        )

    def _operands(self, a, b, c, a_scale, b_scale):
        """Re-type the FP8 views, swap the operands for swap-AB, and build the TMA atoms of A, B, C."""
        if cutlass.const_expr(self.fp8):
            a = cute.make_tensor(cute.recast_ptr(a.iterator, dtype=self.ab_dtype), a.layout)
            b = cute.make_tensor(cute.recast_ptr(b.iterator, dtype=self.ab_dtype), b.layout)
        if cutlass.const_expr(self.swap_ab):  # MMA operands: weights as A, tokens as B, C^T (N-contiguous)
            a, b = b, a
            a_scale, b_scale = b_scale, a_scale
            c = cute.make_tensor(c.iterator, cute.select(c.layout, mode=[1, 0, 2]))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_ta = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, a, cute.slice_(self.a_smem_staged, (None, None, 0)), (self.tile_mnk[0], self.tile_mnk[2])
        )
        tma_b, tma_tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, b, cute.slice_(self.b_smem_staged, (None, None, 0)), (self.tile_mnk[1], self.tile_mnk[2])
        )
        tma_c, tma_tc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            c,
            cute.slice_(self.epi_smem_staged, (None, None, 0)),
            self.epi_tile,
        )
        return a_scale, b_scale, c, tma_a, tma_ta, tma_b, tma_tb, tma_c, tma_tc

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K, L)   uint8 (fp8 bits) or bf16
        b: cute.Tensor,  # (N, K, E)
        c: cute.Tensor,  # (M, N, L)   bf16
        a_scale: cute.Tensor,  # (M, K/128, L) fp32
        b_scale: cute.Tensor,  # (N/128, K/128, E) fp32
        aux: cute.Tensor,  # tile_expert (M/128,) or counts (E,) int32
        pdl: cutlass.Int32,  # 1: programmatic dependent launch (aot.launch.pdl_enabled)
        stream,
    ):
        self._setup()
        a_scale, b_scale, c, tma_a, tma_ta, tma_b, tma_tb, tma_c, tma_tc = self._operands(a, b, c, a_scale, b_scale)
        grid = (
            cute.ceil_div(cute.size(c, mode=[0]), self.tile_m),
            cute.ceil_div(cute.size(c, mode=[1]), self.tile_n),
            cute.size(c, mode=[2]),
        )

        @cute.struct
        class SharedStorage:
            bars: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_staged)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a, tma_ta, tma_b, tma_tb, tma_c, tma_tc, a_scale, b_scale, aux,
            self.tiled_mma, self.tiled_mma, self.tiled_mma,
            self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream, use_pdl=pdl)

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        mSA: cute.Tensor,
        mSB: cute.Tensor,
        aux: cute.Tensor,
        tiled_mma: cute.TiledMma,  # three copies of one MMA: overwrite, accumulate, epilogue layout
        acc_mma: cute.TiledMma,
        epi_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
    ):
        pdl_wait()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        pid_m, pid_n, pid_l = cute.arch.block_idx()
        # the ACCUMULATE flags are set here, once: a flag set inside a loop cannot be read after it
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        acc_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        mmas = (tiled_mma, acc_mma)

        if cutlass.const_expr(self.masked):
            expert = pid_l
            if cutlass.const_expr(self.swap_ab):
                active = pid_n * self.tile_n < aux[pid_l]
            else:
                active = pid_m * self.tile_m < aux[pid_l]
        else:
            expert = aux[pid_m]
            active = expert >= 0
        if active:
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            a_smem = cute.slice_(a_smem_staged, (None, None, 0))
            b_smem = cute.slice_(b_smem_staged, (None, None, 0))
            tx_bytes = cute.size_in_bytes(self.ab_dtype, a_smem) + cute.size_in_bytes(self.ab_dtype, b_smem)

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            ab_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.bars.data_ptr(),
                num_stages=self.ab_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
            pipeline.pipeline_init_arrive()
            sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
            sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
            sC = cute.make_tensor(
                cute.recast_ptr(sA.iterator, epi_smem_staged.inner, dtype=self.c_dtype),
                epi_smem_staged.outer,
            )

            # (bM, bK, RestK), (bN, bK, RestK), (bM, bN); B of the contiguous layout is per tile's expert
            gA = cute.local_tile(mA, self.tile_mnk, (pid_m, pid_n, None, pid_l), proj=(1, None, 1))
            gB = cute.local_tile(mB, self.tile_mnk, (pid_m, pid_n, None, expert), proj=(None, 1, 1))
            gC = cute.local_tile(mC, self.tile_mnk, (pid_m, pid_n, None, pid_l), proj=(1, 1, None))

            wg = cute.arch.make_warp_uniform(tidx // 128)
            thr_mma = tiled_mma.get_slice(cute.make_layout(self.n_wg, stride=128)(wg))
            tCgC = thr_mma.partition_C(gC)

            one = cute.make_layout(1)
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)
            acc.fill(0.0)
            pipeline.pipeline_init_wait()

            k_tiles = cute.size(gA, mode=[2])
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            if warp_idx == 0:
                for _ in cutlass.range(cutlass.min(self.ab_stage, k_tiles), unroll=1):
                    prod = self._load(ab_pipe, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)

            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            num_kb = cute.size(tCrA, mode=[2])
            if cutlass.const_expr(self.fp8):
                # per-thread (row, col) of every accumulator element: slice by the thread, not the warpgroup
                tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
                part0 = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)
                if cutlass.const_expr(self.overlap):
                    part1 = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)
                    cons = self._mma(ab_pipe, cons, mmas, part0, tCrA, tCrB, num_kb, True)
                    for kt in cutlass.range(1, k_tiles, 2, unroll=1):
                        cons = self._mma(ab_pipe, cons, mmas, part1, tCrA, tCrB, num_kb, True)
                        cute.nvgpu.warpgroup.wait_group(1)
                        rel = self._retire(
                            ab_pipe, rel, acc, part0, tCcC, mSA, mSB, kt - 1, pid_m, pid_n, pid_l, expert
                        )
                        if warp_idx == 0 and prod.count < k_tiles:
                            prod = self._load(ab_pipe, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)
                        if kt + 1 < k_tiles:
                            cons = self._mma(ab_pipe, cons, mmas, part0, tCrA, tCrB, num_kb, True)
                            cute.nvgpu.warpgroup.wait_group(1)
                        else:
                            cute.nvgpu.warpgroup.wait_group(0)
                        rel = self._retire(ab_pipe, rel, acc, part1, tCcC, mSA, mSB, kt, pid_m, pid_n, pid_l, expert)
                        if warp_idx == 0 and prod.count < k_tiles:
                            prod = self._load(ab_pipe, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)
                    if k_tiles % 2 == 1:
                        cute.nvgpu.warpgroup.wait_group(0)
                        rel = self._retire(
                            ab_pipe, rel, acc, part0, tCcC, mSA, mSB, k_tiles - 1, pid_m, pid_n, pid_l, expert
                        )
                else:
                    for kt in cutlass.range(k_tiles, unroll=1):
                        cons = self._mma(ab_pipe, cons, mmas, part0, tCrA, tCrB, num_kb, True)
                        cute.nvgpu.warpgroup.wait_group(0)
                        rel = self._retire(ab_pipe, rel, acc, part0, tCcC, mSA, mSB, kt, pid_m, pid_n, pid_l, expert)
                        if warp_idx == 0 and prod.count < k_tiles:
                            prod = self._load(ab_pipe, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)
            else:
                for kt in cutlass.range(k_tiles, unroll=1):
                    cons = self._mma(ab_pipe, cons, mmas, acc, tCrA, tCrB, num_kb, False)
                    cute.nvgpu.warpgroup.wait_group(0)
                    ab_pipe.consumer_release(rel)
                    rel.advance()
                    if warp_idx == 0 and prod.count < k_tiles:
                        prod = self._load(ab_pipe, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)

            # ---- epilogue: registers -> smem (reusing sA) -> TMA store, epi_tile at a time
            cute.arch.sync_threads()
            r2s_atom = sm90_utils.get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype)
            c_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype
            )
            tiled_r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(c_atom, epi_mma))
            thr_r2s = tiled_r2s.get_slice(tidx)
            tRS_sC = thr_r2s.partition_D(sC)
            tRS_acc = tiled_r2s.retile(acc)
            rD_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sC))[:3])
            rD = cute.make_rmem_tensor_like(rD_layout, self.acc_dtype)
            n_rd = cute.size(rD)
            gC_epi = cute.zipped_divide(gC, self.epi_tile)
            bSG_s, bSG_g = cute.nvgpu.cpasync.tma_partition(tma_c, 0, one, cute.group_modes(sC, 0, 2), gC_epi)
            epi_shape = gC_epi.shape[1]
            epi_order = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
            c_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads),
            )
            for e in cutlass.range_constexpr(cute.size(gC_epi, mode=[1])):
                for v in cutlass.range_constexpr(n_rd):
                    rD[v] = tRS_acc[e * n_rd + v]
                rOut = cute.make_rmem_tensor_like(rD_layout, self.c_dtype)
                rOut.store(rD.load().to(self.c_dtype))
                buf = e % self.epi_stage
                cute.copy(tiled_r2s, rOut, tRS_sC[(None, None, None, buf)])
                cute.arch.fence_proxy("async.shared", space="cta")
                pipeline.sync(barrier_id=1)
                if warp_idx == 0:
                    cute.copy(tma_c, bSG_s[(None, buf)], bSG_g[(None, epi_order.get_hier_coord(e))])
                    c_pipe.producer_commit()
                    c_pipe.producer_acquire()
                pipeline.sync(barrier_id=1)
            if warp_idx == 0:
                c_pipe.producer_tail()

    def _load(self, ab_pipe, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB):
        """Producer (warp 0): TMA the next K tile of A and B into the next free stage."""
        ab_pipe.producer_acquire(prod)
        bar = ab_pipe.producer_get_barrier(prod)
        cute.copy(tma_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
        ab_pipe.producer_commit(prod)
        prod.advance()
        return prod

    def _mma(self, ab_pipe, cons, mmas, frag, tCrA, tCrB, num_kb, fresh):
        """Wait for the next stage and issue its wgmmas into `frag` (overwritten first if fresh)."""
        ab_pipe.consumer_wait(cons)
        cute.nvgpu.warpgroup.fence()
        for kb in range(num_kb):
            coord = (None, None, kb, cons.index)
            mma = mmas[0] if (fresh and kb == 0) else mmas[1]
            cute.gemm(mma, frag, tCrA[coord], tCrB[coord], frag)
        cute.nvgpu.warpgroup.commit_group()
        cons.advance()
        return cons

    def _retire(self, ab_pipe, rel, acc, part, tCcC, mSA, mSB, kt, pid_m, pid_n, pid_l, expert):
        """Free the finished stage and promote: acc += part * a_scale[row] * b_scale[block]."""
        ab_pipe.consumer_release(rel)
        rel.advance()
        if self.swap_ab:  # A = weights (one scale per 128 rows), B = tokens
            sw = mSA[(pid_m * self.tile_m // SCALE_BLOCK, kt, expert)]
            n0 = pid_n * self.tile_n
            for i in range(cute.size(acc)):
                acc[i] = acc[i] + part[i] * (mSB[(n0 + tCcC[i][1], kt, pid_l)] * sw)
        else:
            sb = mSB[(pid_n * self.tile_n // SCALE_BLOCK, kt, expert)]
            m0 = pid_m * self.tile_m
            for i in range(cute.size(acc)):
                acc[i] = acc[i] + part[i] * (mSA[(m0 + tCcC[i][0], kt, pid_l)] * sb)
        return rel


@cute.jit
def pdl_wait():
    """Every grouped GEMM's first step: wait for the previous kernel of the stream (its writes, the
    activations and tile tables, are then visible; a no-op when this launch is not programmatic),
    then let the next kernel launch (it waits for this grid's completion itself). In a decode graph
    the GEMM's blocks are then resident while the quantizing kernel before it drains, and the one
    after it while the GEMM drains."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()


def _fake_args(fp8: bool, masked: bool):
    """Fake tensors (symbolic sizes) matching the torch views documented in the module docstring."""
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    m, n, k, e, l, kb, nb, t = (cute.sym_int() for _ in range(8))
    ab = cutlass.Uint8 if fp8 else cutlass.BFloat16
    kmaj = (1, 0, 2)  # mode 1 (K or N) is the stride-1 mode, the batch mode is outermost
    a = make_fake_compact_tensor(ab, (m, k, l), stride_order=kmaj, assumed_align=16)
    b = make_fake_compact_tensor(ab, (n, k, e), stride_order=kmaj, assumed_align=16)
    c = make_fake_compact_tensor(cutlass.BFloat16, (m, n, l), stride_order=kmaj, assumed_align=16)
    if not fp8:  # the scales are ignored: 1-element placeholders of any size
        m, kb, l, e = (cute.sym_int() for _ in range(4))
    sa = make_fake_compact_tensor(cutlass.Float32, (m, kb, l), stride_order=(0, 1, 2), assumed_align=4)
    sb = make_fake_compact_tensor(cutlass.Float32, (nb, kb, e), stride_order=kmaj, assumed_align=4)
    aux = make_fake_compact_tensor(cutlass.Int32, (t,), assumed_align=4)
    return a, b, c, sa, sb, aux, make_fake_stream(use_tvm_ffi_env_stream=True)


def _export(gemm, fp8: bool, masked: bool, arch: str, clusters: bool = False):
    """cute.compile of one variant against the fake arguments: (a, b, c, sa, sb, aux[, clusters], pdl, stream)."""
    *args, stream = _fake_args(fp8, masked)
    extra = (cutlass.Int32(0),) * (2 if clusters else 1)
    return cute.compile(gemm, *args, *extra, stream, options=f"--gpu-arch {arch} --enable-tvm-ffi")


VARIANTS = {
    "grouped_gemm_fp8_contig": dict(fp8=True, masked=False, overlap=True),
    "grouped_gemm_fp8_masked": dict(fp8=True, masked=True, overlap=True),
    "grouped_gemm_fp8_masked_swapab": dict(fp8=True, masked=True, swap_ab=True, overlap=True),
    "grouped_gemm_fp8_contig_serial": dict(fp8=True, masked=False),
    "grouped_gemm_fp8_masked_serial": dict(fp8=True, masked=True),
    "grouped_gemm_bf16_contig": dict(fp8=False, masked=False),
    "grouped_gemm_bf16_masked": dict(fp8=False, masked=True),
}


def compile_for_export(arch: str = "sm_90a") -> dict:
    """{export name: compiled fn} for every entry of VARIANTS (arguments: module docstring)."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch={arch!r}: the wgmma grouped GEMM needs sm_90a")
    return {name: _export(GroupedGemmSm90(**kw), kw["fp8"], kw["masked"], arch) for name, kw in VARIANTS.items()}
