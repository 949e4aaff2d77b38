"""Blackwell (sm_100a) MXFP8 block-scaled grouped GEMM for the MoE experts, in CuTeDSL (tcgen05).

C[rows of expert e] = A[rows of e] @ B[e]^T with E4M3 operands and one E8M0 scale per 32 along K
for both, applied exactly by the tensor cores (`tcgen05.mma ... kind::mxf8f6f4.block_scale`).
One CTA of 128 threads computes a 128 x 128 tile: warp 0 issues the TMA loads (A, B and their scale
factors) of a `num_ab_stage`-deep ring and the MMAs into tensor memory (the scale factors go
smem -> tmem with tcgen05.cp); then all four warps read the accumulator back (tcgen05.ld) and store
bf16. The structure follows CUTLASS's first block-scaled tutorial GEMM, written for our layouts.

Layouts are those of moe/kernels/sm90_grouped_gemm.py (contiguous with `aux` = tile_expert, or
masked with `aux` = counts), with rows and N multiples of 128. Scale factors travel as flat uint8
buffers in the 128 x 4 swizzled layout of `moe.mxfp8.swizzle_scales`, one block per batch:
  sfa: swizzle_scales(a_scale[l]) for l in range(L), concatenated (a_scale [L, rows, K/32])
  sfb: swizzle_scales(b_scale[e]) for e in range(E), concatenated (b_scale [E, N, K/32])
Status: compiles for sm_100a on a CPU machine (tests/moe/test_compile.py); never run on a GPU here
(no Blackwell machine was available), so its results are unverified.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import cpasync, tcgen05

ARCHS = ("sm_100a",)  # for aot.build
SF_VEC = 32
AB_DTYPE = cutlass.Float8E4M3FN
SF_DTYPE = cutlass.Float8E8M0FNU
C_DTYPE = cutlass.BFloat16


class GroupedGemmSm100Mxfp8:
    """One compiled variant: contiguous (tile_expert) or masked (counts) layout."""

    def __init__(self, masked: bool):
        self.masked = masked
        self.threads = 128
        self.mma_tiler = (128, 128, 4 * 32)  # Mma-K is 32 for MXF8; 4 MMAs per K tile
        self.num_ab_stage = 6
        self.tmem_cols = 512

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K, L)  uint8 = E4M3 bits
        b: cute.Tensor,  # (N, K, E)  uint8 = E4M3 bits
        c: cute.Tensor,  # (M, N, L)  bf16
        sfa: cute.Tensor,  # flat uint8, swizzled (see module docstring)
        sfb: cute.Tensor,  # flat uint8, swizzled
        aux: cute.Tensor,  # tile_expert (M/128,) or counts (E,) int32
        stream,
    ):
        a = cute.make_tensor(cute.recast_ptr(a.iterator, dtype=AB_DTYPE), a.layout)
        b = cute.make_tensor(cute.recast_ptr(b.iterator, dtype=AB_DTYPE), b.layout)
        sfa_t = cute.make_tensor(
            cute.recast_ptr(sfa.iterator, dtype=SF_DTYPE), blockscaled_utils.tile_atom_to_shape_SF(a.shape, SF_VEC)
        )
        sfb_t = cute.make_tensor(
            cute.recast_ptr(sfb.iterator, dtype=SF_DTYPE), blockscaled_utils.tile_atom_to_shape_SF(b.shape, SF_VEC)
        )
        mma_op = tcgen05.MmaMXF8F6F4Op(
            AB_DTYPE,
            AB_DTYPE,
            (self.mma_tiler[0], self.mma_tiler[1], 32),
            tcgen05.CtaGroup.ONE,
            tcgen05.OperandSource.SMEM,
            tcgen05.OperandMajorMode.K,
            tcgen05.OperandMajorMode.K,
        )
        tiled_mma = cute.make_tiled_mma(mma_op)
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, AB_DTYPE, self.num_ab_stage)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, AB_DTYPE, self.num_ab_stage)
        sfa_smem = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, SF_VEC, self.num_ab_stage)
        sfb_smem = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, SF_VEC, self.num_ab_stage)
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        one_stage = (None, None, None, 0)
        tma_a, tma_ta = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, a, cute.slice_(a_smem, one_stage), self.mma_tiler, tiled_mma, cluster_vmnk.shape
        )
        tma_b, tma_tb = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, b, cute.slice_(b_smem, one_stage), self.mma_tiler, tiled_mma, cluster_vmnk.shape
        )
        tma_sfa, tma_tsfa = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, sfa_t, cute.slice_(sfa_smem, one_stage), self.mma_tiler, tiled_mma, cluster_vmnk.shape,
            internal_type=cutlass.Int16,
        )
        tma_sfb, tma_tsfb = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, sfb_t, cute.slice_(sfb_smem, one_stage), self.mma_tiler, tiled_mma, cluster_vmnk.shape,
            internal_type=cutlass.Int16,
        )
        self.tx_bytes = (
            cute.size_in_bytes(AB_DTYPE, cute.slice_(a_smem, one_stage))
            + cute.size_in_bytes(AB_DTYPE, cute.slice_(b_smem, one_stage))
            + cute.size_in_bytes(SF_DTYPE, cute.slice_(sfa_smem, one_stage))
            + cute.size_in_bytes(SF_DTYPE, cute.slice_(sfb_smem, one_stage))
        )
        grid = (
            cute.ceil_div(cute.size(c, mode=[0]), self.mma_tiler[0]),
            cute.ceil_div(cute.size(c, mode=[1]), self.mma_tiler[1]),
            cute.size(c, mode=[2]),
        )
        self.kernel(
            tiled_mma, tma_a, tma_ta, tma_b, tma_tb, tma_sfa, tma_tsfa, tma_sfb, tma_tsfb, c, aux,
            a_smem, b_smem, sfa_smem, sfb_smem,
        ).launch(grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        mC: cute.Tensor,
        aux: cute.Tensor,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        sfa_smem: cute.Layout,
        sfb_smem: cute.Layout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        pid_m, pid_n, pid_l = cute.arch.block_idx()
        if cutlass.const_expr(self.masked):
            expert = pid_l
            active = pid_m * self.mma_tiler[0] < aux[pid_l]
        else:
            expert = aux[pid_m]
            active = expert >= 0
        if active:

            @cute.struct
            class SharedStorage:
                ab_bars: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage * 2]
                acc_bars: cute.struct.MemRange[cutlass.Int64, 2]
                tmem_holding_buf: cutlass.Int32

            smem = utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sA = smem.allocate_tensor(AB_DTYPE, a_smem.outer, byte_alignment=128, swizzle=a_smem.inner)
            sB = smem.allocate_tensor(AB_DTYPE, b_smem.outer, byte_alignment=128, swizzle=b_smem.inner)
            sSFA = smem.allocate_tensor(SF_DTYPE, sfa_smem, byte_alignment=128)
            sSFB = smem.allocate_tensor(SF_DTYPE, sfb_smem, byte_alignment=128)

            producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
            ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.ab_bars.data_ptr(),
                num_stages=self.num_ab_stage,
                producer_group=producer_group,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                tx_count=self.tx_bytes,
            ).make_participants()
            acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
                barrier_storage=storage.acc_bars.data_ptr(),
                num_stages=1,
                producer_group=producer_group,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads),
            ).make_participants()

            tile_a = cute.slice_(self.mma_tiler, (None, 0, None))
            tile_b = cute.slice_(self.mma_tiler, (0, None, None))
            # (bM, bK, RestK) / (bN, bK, RestK) / (bM, bN): A, SFA, C at batch pid_l; B, SFB at the expert
            gA = cute.local_tile(mA, tile_a, (pid_m, None, pid_l))
            gSFA = cute.local_tile(mSFA, tile_a, (pid_m, None, pid_l))
            gB = cute.local_tile(mB, tile_b, (pid_n, None, expert))
            gSFB = cute.local_tile(mSFB, tile_b, (pid_n, None, expert))
            gC = cute.local_tile(mC, cute.slice_(self.mma_tiler, (None, None, 0)), (pid_m, pid_n, pid_l))
            k_tiles = cute.size(gA, mode=[2])

            thr_mma = tiled_mma.get_slice(0)
            tCgA, tCgB = thr_mma.partition_A(gA), thr_mma.partition_B(gB)
            tCgSFA, tCgSFB = thr_mma.partition_A(gSFA), thr_mma.partition_B(gSFB)
            tCgC = thr_mma.partition_C(gC)
            one = cute.make_layout(1)
            tAsA, tAgA = cpasync.tma_partition(tma_a, 0, one, cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3))
            tBsB, tBgB = cpasync.tma_partition(tma_b, 0, one, cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))
            tAsSFA, tAgSFA = cpasync.tma_partition(
                tma_sfa, 0, one, cute.group_modes(sSFA, 0, 3), cute.group_modes(tCgSFA, 0, 3)
            )
            tBsSFB, tBgSFB = cpasync.tma_partition(
                tma_sfb, 0, one, cute.group_modes(sSFB, 0, 3), cute.group_modes(tCgSFB, 0, 3)
            )
            tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
            tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)

            tCrA = tiled_mma.make_fragment_A(sA)
            tCrB = tiled_mma.make_fragment_B(sB)
            acc_fake = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2]))

            tmem = utils.TmemAllocator(
                storage.tmem_holding_buf,
                barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=self.threads),
            )
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(cutlass.Float32)
            tCtAcc = cute.make_tensor(acc_ptr, acc_fake.layout)
            sfa_ptr = cute.recast_ptr(acc_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc), dtype=SF_DTYPE)
            tCtSFA = cute.make_tensor(
                sfa_ptr,
                blockscaled_utils.make_tmem_layout_sfa(
                    tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfa_smem, (None, None, None, 0))
                ),
            )
            sfb_ptr = cute.recast_ptr(
                acc_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc) + tcgen05.find_tmem_tensor_col_offset(tCtSFA),
                dtype=SF_DTYPE,
            )
            tCtSFB = cute.make_tensor(
                sfb_ptr,
                blockscaled_utils.make_tmem_layout_sfb(
                    tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfb_smem, (None, None, None, 0))
                ),
            )
            s2t_atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), SF_DTYPE)
            tCtSFA_c, tCtSFB_c = cute.filter_zeros(tCtSFA), cute.filter_zeros(tCtSFB)
            s2t_sfa = tcgen05.make_s2t_copy(s2t_atom, tCtSFA_c)
            s2t_sfb = tcgen05.make_s2t_copy(s2t_atom, tCtSFB_c)
            thr_sfa, thr_sfb = s2t_sfa.get_slice(0), s2t_sfb.get_slice(0)
            sfa_src = tcgen05.get_s2t_smem_desc_tensor(s2t_sfa, thr_sfa.partition_S(cute.filter_zeros(sSFA)))
            sfb_src = tcgen05.get_s2t_smem_desc_tensor(s2t_sfb, thr_sfb.partition_S(cute.filter_zeros(sSFB)))
            sfa_dst, sfb_dst = thr_sfa.partition_D(tCtSFA_c), thr_sfb.partition_D(tCtSFB_c)

            if warp_idx == 0:
                acc_empty = acc_producer.acquire_and_advance()
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for _ in cutlass.range(k_tiles, prefetch_stages=self.num_ab_stage - 2):
                    ab_empty = ab_producer.acquire_and_advance()
                    kt, st = ab_empty.count, ab_empty.index
                    cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, st)], tma_bar_ptr=ab_empty.barrier)
                    cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, st)], tma_bar_ptr=ab_empty.barrier)
                    cute.copy(tma_sfa, tAgSFA[(None, kt)], tAsSFA[(None, st)], tma_bar_ptr=ab_empty.barrier)
                    cute.copy(tma_sfb, tBgSFB[(None, kt)], tBsSFB[(None, st)], tma_bar_ptr=ab_empty.barrier)
                    ab_full = ab_consumer.wait_and_advance()
                    stage = (None, None, None, None, ab_full.index)
                    cute.copy(s2t_sfa, sfa_src[stage], sfa_dst)
                    cute.copy(s2t_sfb, sfb_src[stage], sfb_dst)
                    for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                        tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kb)].iterator)
                        tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kb)].iterator)
                        coord = (None, None, kb, ab_full.index)
                        cute.gemm(tiled_mma, tCtAcc, tCrA[coord], tCrB[coord], tCtAcc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    ab_full.release()
                acc_empty.commit()

            # ---- epilogue: tmem -> registers (one row per thread) -> bf16 -> global
            t2r = tcgen05.make_tmem_copy(
                cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x128, tcgen05.Pack.NONE), cutlass.Float32),
                tCtAcc,
            )
            thr_t2r = t2r.get_slice(tidx)
            tTR_tAcc = thr_t2r.partition_S(tCtAcc)
            tTR_gC = thr_t2r.partition_D(tCgC)
            rAcc = cute.make_rmem_tensor(tTR_gC.shape, cutlass.Float32)
            rC = cute.make_rmem_tensor(tTR_gC.shape, C_DTYPE)
            tmem.relinquish_alloc_permit()
            acc_full = acc_consumer.wait_and_advance()
            cute.copy(t2r, tTR_tAcc, rAcc)
            rC.store(rAcc.load().to(C_DTYPE))
            cute.copy(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), C_DTYPE), rC, tTR_gC)
            acc_full.release()
            cute.arch.barrier()
            tmem.free(acc_ptr)


def _fake_args(masked: bool):
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    m, n, k, e, l, fa, fb, t = (cute.sym_int() for _ in range(8))
    kmaj = (1, 0, 2)
    a = make_fake_compact_tensor(cutlass.Uint8, (m, k, l), stride_order=kmaj, assumed_align=16)
    b = make_fake_compact_tensor(cutlass.Uint8, (n, k, e), stride_order=kmaj, assumed_align=16)
    c = make_fake_compact_tensor(cutlass.BFloat16, (m, n, l), stride_order=kmaj, assumed_align=16)
    sfa = make_fake_compact_tensor(cutlass.Uint8, (fa,), assumed_align=16)
    sfb = make_fake_compact_tensor(cutlass.Uint8, (fb,), assumed_align=16)
    aux = make_fake_compact_tensor(cutlass.Int32, (t,), assumed_align=4)
    return a, b, c, sfa, sfb, aux, make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_for_export(arch: str = "sm_100a") -> dict:
    """{export name: compiled fn} for the contiguous and masked layouts."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: the tcgen05 block-scaled GEMM needs sm_100a")
    return {
        f"mxfp8_grouped_gemm_{'masked' if masked else 'contig'}": cute.compile(
            GroupedGemmSm100Mxfp8(masked), *_fake_args(masked), options=f"--gpu-arch {arch} --enable-tvm-ffi"
        )
        for masked in (False, True)
    }
