"""Hopper (sm_90a) FP8 grouped GEMM, warp-specialized and persistent (CuTeDSL).

Same operands, layouts, scale contract and call convention as moe/kernels/sm90_grouped_gemm.py
(the module docstring there: views, `aux`, power-of-two block scales promoted once per 128-wide K
tile); FP8 only. What differs is the schedule, written after the structure of CUTLASS's Hopper
persistent / warp-specialized GEMMs:

  * warpgroup 0 is the producer: its warp 0 issues the TMA loads of A and B into an `ab_stage`-deep
    shared-memory ring and never computes; warpgroups 1..n_wg consume (one 64-row slice of the tile
    each); the contiguous kernels move registers from the producer to the consumers (setmaxnreg);
  * persistent: min(#tiles, NUM_SMS) CTAs walk the tiles with a static stride; producer and
    consumers walk the same sequence and skip the same inactive tiles (masked tiles at or past
    counts[e], contiguous tiles with tile_expert -1), so the producer streams the next tile's K
    tiles while the consumers promote and store the current one;
  * the epilogue writes through its own shared-memory buffers (not the A/B ring, which the
    producer is refilling) and TMA-stores them, one named barrier over the consumer threads;
  * the scale factors of a K tile are read before the wait for its wgmma (latency hidden behind
    the MMA); `overlap` keeps two temporary accumulators so the promotion of K tile t runs while
    the wgmma of K tile t+1 is in flight. The K loop is written as branch-free pairs: with a
    data-dependent wait inside the loop (as in sm90_grouped_gemm's overlapped variant) ptxas cannot
    tell which temporary a wait retires and serializes every wgmma (warning C7514, checked with
    `ptxas -v` on the kept PTX), which is why that variant never overlapped.

Variants: the swap-AB masked kernel (decode: weights are the 128- or 64-row M operand, the few
tokens of an expert the N operand; token tiles outermost in the tile order, so every CTA first
streams distinct weight tiles) and the contiguous kernel (prefill, 128 x 128 tiles, n-tiles
innermost so concurrent CTAs share an expert's A rows and weights in L2), plus a contiguous ping-pong
kernel for the compute-bound prefill sizes (GroupedGemmSm90WSPingPong: 128 x 256 tiles, the two
consumer warpgroups take turns to issue their wgmma chains; its docstring has the details).
Decode options of the masked kernel (both off in the first variants, measured 2026-11-22: 62-65% of
the copy bandwidth at 128 tokens, slower than the classic kernel at 1-8 tokens):
  * compact: the tile walk covers only the active (expert, token tile) pairs. Each CTA first turns
    counts into an exclusive prefix sum of token tiles per expert in shared memory (all threads
    fill, one warp scans; at most MAX_EXPERTS experts), then maps its linear work index to
    (expert, token tile, weight tile) by a 10-step binary search over that prefix. Without it a
    CTA visits every (weight tile, expert, token tile) of the capacity: at 1 token with the
    capacity 128 that is 93 + 124 visits per CTA for 8 active experts, each a counts load, and the
    active tiles fall unevenly on the CTAs; compact ones are dealt out round-robin.
  * prefetch (needs compact, not overlap): the scale factors of K step s + 1 (or of the next tile's
    first K step) are loaded while the wgmma of step s runs and used one step later, so a K step's
    critical path in the consumers is the wgmma and the promotion, not a global-memory round trip
    for the scales. A decode K step moves only 16-20 KB, so that latency per step bounded the
    streaming rate of each SM.
  * k_group (the `_kg2` / `_kg4` decode variants): the producer waits for k_group free stages and then
    requests k_group consecutive K tiles back to back, so each of the 128 weight rows of a tile is read
    as k_group * 128 contiguous bytes at once instead of 128-byte pieces a stage apart (the weight
    stream at 74% of copy bandwidth is not short of bytes in flight: ~10 stages of 20 KB per SM;
    the hypothesis is DRAM locality). Not measured yet.
  * stage_scales (needs compact and overlap; the `_cps` variants, few tokens): at the start of each
    tile the consumer threads load all its promotion factors, token scale x weight scale for every
    (token column, K tile), into shared memory in one round of independent loads (one L2 latency
    per tile, overlapped with the producer's first TMA loads), then each K step reads its factors
    from shared memory. In `_cpo` each K step's promotion waits for its own global scale loads, so
    a CTA retires at most one K step per L2 round trip: at 1 token (235B shape) ~1.1 us per
    20 KB step, 18 GB/s per SM, against ~0.6 us at 8 tokens where DRAM is the limit. Needs
    K <= 128 * MAX_SCALE_K_TILES (8 KB of shared memory at tile_n 32). Not measured yet.
Prefill options of the 128 x 256 kernel (not measured yet; the A/B against _n256 is in perf.moe):
  * epi_buffers=4 (`_n256_e4`): four 128 x 32 epilogue buffers (32 KB; 4 A/B stages of 48 KB still
    fit) instead of two, so the store warp's wait for a TMA store to leave shared memory rarely blocks
    the 8 sub-tile stores of a tile (the consumers' tensor cores idle during the epilogue).
  * cluster=2 (`_n256_mc`): clusters of 2 CTAs along M take m tiles 2q and 2q + 1 of the same pair of
    n tiles; each CTA TMA-loads one 128-row half of the shared B tile and multicasts it into both, so
    L2 -> SM traffic per stage drops from 48 to 32 KB per CTA (at 16384 tokens the 128 x 256 kernel
    moves ~31 GB through L2 in ~5.8 ms, near the L2 bandwidth). Across an expert boundary (the two m
    tiles name different experts) each CTA loads both halves for itself; an m tile past the end or
    unused (-1) loads its partner's operands and stores nothing, so both CTAs run the same pipeline
    steps. Every consumer warp releases a stage in both CTAs; the kernel ends on a cluster barrier.
    Its grid is sized on the host (GroupedGemmSm90WSCluster: an extra `clusters` argument, the
    number of 2-CTA clusters the device can hold at once), and each cluster strides over the units
    by the number of clusters launched.
  * prefetch_scales (`_n256_sp`): the promotion factors' operands of K step kt + 1 (one A-row scale per
    distinct row of a thread's fragment, 2, and the two B-block scales) are loaded while the wgmmas of
    step kt run, and on a tile's last step those of the CTA's next tile's first step; `_n256` loads them
    after issuing the step's wgmmas and waits for them before promoting, so each half-step's promotion
    can wait on an L2 round trip (more than the ~64 x 128 x 128 wgmma of a warpgroup takes). Registers:
    2 x (2 + 2) more per consumer thread, no spills (ptxas -v on the PTX).
  * _n256_mc_e2: _n256_mc with the 2 epilogue buffers of _n256 (the A/B for the _e4 part of _mc);
    _n256_mc_e2_sp: that with prefetch_scales.
NUM_SMS is H100/H200 SXM's 132 (the 1-CTA kernels' grid): on a part with fewer SMs the extra CTAs
wait for a free SM (correct, not optimal).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

from moe.kernels.sm90_grouped_gemm import SCALE_BLOCK, GroupedGemmSm90, _export, pdl_wait

ARCHS = ("sm_90a",)
NUM_SMS = 132
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # 128 * 40 + 256 * 232 <= 64K registers per SM
MAX_AB_STAGES = 16
MAX_EXPERTS = 1024  # the compact walk's shared prefix array (experts per masked call)
LOG_MAX_EXPERTS = 10
MAX_SCALE_K_TILES = 64  # stage_scales: K tiles of 128 whose promotion factors fit the shared array (K <= 8192)


class GroupedGemmSm90WS(GroupedGemmSm90):
    """One warp-specialized persistent FP8 variant.

    masked: the swap-AB masked layout (decode) instead of the contiguous one.
    n_wg: consumer warpgroups (tile rows = 64 * n_wg). tile_n: tile columns (tokens for swap-AB).
    overlap: promotion of K tile t overlapped with the wgmma of K tile t+1 (two temporaries).
    compact, prefetch, k_group, stage_scales: the decode options of the module docstring (masked only).
    """

    def __init__(
        self,
        masked: bool,
        n_wg: int = 2,
        tile_n: int = 128,
        overlap: bool = False,
        compact: bool = False,
        prefetch: bool = False,
        k_group: int = 1,
        stage_scales: bool = False,
    ):
        super().__init__(fp8=True, masked=masked, swap_ab=masked, overlap=overlap)
        if k_group not in (1, 2, 4):
            raise ValueError(f"k_group={k_group}: need 1, 2 or 4 K tiles per producer burst")
        self.k_group = k_group
        self.epi_buffers = None  # epilogue smem buffers (None: 2, or 1 for an odd sub-tile count)
        if n_wg not in (1, 2) or tile_n % 8 or not 8 <= tile_n <= 256:
            raise ValueError(f"n_wg={n_wg}, tile_n={tile_n}: need n_wg in (1, 2) and tile_n a multiple of 8 in [8, 256]")
        if compact and not masked:
            raise ValueError(f"compact={compact}: the compact tile walk is for the masked layout only")
        if prefetch and (overlap or not compact):
            raise ValueError(f"prefetch={prefetch} needs compact=True and overlap=False (got {compact}, {overlap})")
        if stage_scales and not (compact and overlap):
            raise ValueError(f"stage_scales={stage_scales} needs compact=True and overlap=True (got {compact}, {overlap})")
        self.compact, self.prefetch, self.stage_scales = compact, prefetch, stage_scales
        if not masked and tile_n != SCALE_BLOCK:
            raise ValueError(f"tile_n={tile_n}: the contiguous kernel needs tile_n == {SCALE_BLOCK} (one B scale per tile)")
        self.tile_m, self.tile_n, self.n_wg = 64 * n_wg, tile_n, n_wg
        self.b_tiles = 1  # B tiles (tile_n rows each) per CTA tile and pipeline stage
        self.mma_threads = 128 * n_wg
        self.threads = 128 + self.mma_threads
        self.store_warp = 4  # first consumer warp issues the TMA stores

    def _setup(self):
        super()._setup()
        m, n = self.epi_tile
        n_sub = (self.tile_m // m) * (self.tile_n // n)
        self.epi_stage = 2 if n_sub % 2 == 0 else 1  # buffer e % epi_stage restarts at 0 on each tile
        if self.epi_buffers is not None:
            if n_sub % self.epi_buffers:
                raise ValueError(f"epi_buffers={self.epi_buffers} must divide the {n_sub} epilogue sub-tiles of a tile")
            self.epi_stage = self.epi_buffers
        epi_bytes = m * n * self.epi_stage * self.c_dtype.width // 8
        stage_bytes = (self.tile_m + self.b_tiles * self.tile_n) * self.tile_mnk[2] * self.ab_dtype.width // 8
        self.n_prefix = MAX_EXPERTS + 1 if self.compact else 1
        self.n_factors = self.tile_n * MAX_SCALE_K_TILES if self.stage_scales else 1
        free = self.smem_capacity - 2048 - epi_bytes - 4 * self.n_prefix - 4 * self.n_factors
        self.ab_stage = min(MAX_AB_STAGES, free // stage_bytes)
        if self.ab_stage < max(self.k_group, 3):
            raise ValueError(f"{self.ab_stage} A/B stages fit in shared memory: need 3 and k_group={self.k_group}")
        k_major = utils.LayoutEnum.ROW_MAJOR
        self.a_smem_staged = sm90_utils.make_smem_layout_a(k_major, self.tile_mnk, self.ab_dtype, self.ab_stage)
        # stage s holds B tile h of the CTA tile at index s * b_tiles + h
        self.b_smem_staged = sm90_utils.make_smem_layout_b(
            k_major, self.tile_mnk, self.ab_dtype, self.ab_stage * self.b_tiles
        )
        self.epi_smem_staged = sm90_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage)

    def _shared_storage(self, factors: bool = True):
        """The shared-memory struct of every variant (after _setup): the A/B ring's barriers, the A, B
        and epilogue buffers, the compact walk's prefix and, with `factors`, the staged promotion factors."""
        align = cute.struct.Align
        fields = {
            "bars": cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2],
            "sA": align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_staged)], 1024],
            "sB": align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_staged)], 1024],
            "sC": align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_staged)], 1024],
            "prefix": cute.struct.MemRange[cutlass.Int32, self.n_prefix],
        }
        if factors:
            fields["factors"] = cute.struct.MemRange[cutlass.Float32, self.n_factors]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        c: cute.Tensor,
        a_scale: cute.Tensor,
        b_scale: cute.Tensor,
        aux: cute.Tensor,
        pdl: cutlass.Int32,
        stream,
    ):
        self._setup()
        a_scale, b_scale, c, tma_a, tma_ta, tma_b, tma_tb, tma_c, tma_tc = self._operands(a, b, c, a_scale, b_scale)
        num_tiles = (
            cute.ceil_div(cute.size(c, mode=[0]), self.tile_m)
            * cute.ceil_div(cute.size(c, mode=[1]), self.tile_n * self.b_tiles)
            * cute.size(c, mode=[2])
        )

        self.shared_storage = self._shared_storage()
        self.kernel(
            tma_a, tma_ta, tma_b, tma_tb, tma_c, tma_tc, a_scale, b_scale, aux,
            self.tiled_mma, self.tiled_mma, self.tiled_mma,
            self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
        ).launch(grid=(cutlass.min(num_tiles, NUM_SMS), 1, 1), block=[self.threads, 1, 1], stream=stream,
                 use_pdl=pdl)

    @cute.jit
    def _tile(self, t, tiles_m, tiles_n, n_l, aux, sP):
        """Linear tile index -> (m tile, n tile, batch, expert, active)."""
        if cutlass.const_expr(self.compact):  # t counts active tiles only: (weight tile fastest, token tile, expert)
            pm = t % tiles_m
            g = t // tiles_m
            e = cutlass.Int32(0)  # the last expert whose first token tile is at or before g
            for b in cutlass.range_constexpr(LOG_MAX_EXPERTS):
                cand = e + (1 << (LOG_MAX_EXPERTS - 1 - b))
                if cand < n_l:
                    if sP[cand] <= g:
                        e = cand
            return pm, g - sP[e], e, e, True
        if cutlass.const_expr(self.masked):  # (weight tile fastest, expert, token tile outermost)
            pm = t % tiles_m
            pl = (t // tiles_m) % n_l
            pn = t // (tiles_m * n_l)
            return pm, pn, pl, pl, pn * self.tile_n < aux[pl]
        pn = t % tiles_n
        pm = t // tiles_n
        expert = aux[pm]
        return pm, pn, cutlass.Int32(0), expert, expert >= 0

    @cute.jit
    def _stage_factors(self, sF, mSA, mSB, k_tiles, pm, pn, pl, expert, ctid, factor_bar):
        """stage_scales: sF[kt * tile_n + j] = token scale (row pn * tile_n + j) x weight scale of K tile kt,
        for the whole tile, by all consumer threads (independent loads), then a consumer-wide barrier.
        The previous tile's reads are over: its epilogue ended on a consumer-wide barrier."""
        n0 = pn * self.tile_n
        wrow = pm * self.tile_m // SCALE_BLOCK
        for idx in cutlass.range(ctid, k_tiles * self.tile_n, self.mma_threads, unroll=1):
            kt = idx // self.tile_n
            sF[idx] = mSB[(n0 + idx % self.tile_n, kt, pl)] * mSA[(wrow, kt, expert)]
        factor_bar.arrive_and_wait()

    @cute.jit
    def _prefix(self, sP, aux, n_l, tiles_n, tidx, warp_idx):
        """sP[e] = token tiles of experts before e, sP[n_l] = all of them (counts -> exclusive scan);
        ends with the CTA-wide sync that also completes the pipeline set-up."""
        for e in cutlass.range(tidx, n_l, self.threads, unroll=1):
            sP[e] = cutlass.min((aux[e] + self.tile_n - 1) // self.tile_n, tiles_n)
        cute.arch.sync_threads()
        if warp_idx == 0:  # each lane sums a block of experts, a warp scan gives the block offsets
            lane = tidx % 32
            per = (n_l + 31) // 32
            lo = lane * per
            own = cutlass.Int32(0)
            for i in cutlass.range(per, unroll=1):
                if lo + i < n_l:
                    own = own + sP[lo + i]
            incl = own
            for b in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << b)
                if lane >= (1 << b):
                    incl = incl + up
            run = incl - own
            for i in cutlass.range(per, unroll=1):
                if lo + i < n_l:
                    c = sP[lo + i]
                    sP[lo + i] = run
                    run = run + c
            if lane == 31:
                sP[n_l] = incl
        pipeline.pipeline_init_wait()

    @cute.jit
    def _load_group(self, ab_pipe, prod, n, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB):
        """Producer: wait until n stages are free, then TMA K tiles prod.count .. + n - 1 back to back,
        so each row of the tile is requested as n * 128 contiguous bytes at once (k_group)."""
        acq = prod.clone()
        for _ in cutlass.range(n, unroll=1):
            ab_pipe.producer_acquire(acq)
            acq.advance()
        for _ in cutlass.range(n, unroll=1):
            bar = ab_pipe.producer_get_barrier(prod)
            cute.copy(tma_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
            ab_pipe.producer_commit(prod)
            prod.advance()
        return prod

    def _scales(self, mSA, mSB, tCcC, kt, pm, pn, pl, expert, f=None, sF=None):
        """Per-element promotion factors of K tile kt (loaded before the wgmma wait), into f if given;
        from the tile's staged factors sF (stage_scales: [K tile][token column]) if given."""
        if cutlass.const_expr(f is None):
            f = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        if cutlass.const_expr(sF is not None):
            for i in range(cute.size(f)):
                f[i] = sF[kt * self.tile_n + tCcC[i][1]]
        elif cutlass.const_expr(self.swap_ab):  # A = weights (one scale per 128 rows), B = tokens
            sw = mSA[(pm * self.tile_m // SCALE_BLOCK, kt, expert)]
            n0 = pn * self.tile_n
            for i in range(cute.size(f)):
                f[i] = mSB[(n0 + tCcC[i][1], kt, pl)] * sw
        else:
            sb = mSB[(pn * self.tile_n // SCALE_BLOCK, kt, expert)]
            m0 = pm * self.tile_m
            for i in range(cute.size(f)):
                f[i] = mSA[(m0 + tCcC[i][0], kt, pl)] * sb
        return f

    def _promote(self, ab_pipe, rel, acc, part, f):
        """Free the finished stage, then acc += part * f."""
        ab_pipe.consumer_release(rel)
        rel.advance()
        for i in range(cute.size(acc)):
            acc[i] = acc[i] + part[i] * f[i]
        return rel

    def _epilogue_setup(self, epi_mma, sC, ctid):
        """The consumers' register -> shared-memory copy and the TMA-store pipeline of the epilogue."""
        r2s_atom = sm90_utils.get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype)
        c_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype)
        tiled_r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(c_atom, epi_mma))
        thr_r2s = tiled_r2s.get_slice(ctid)
        rD_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sC))[:3])
        c_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads),
        )
        epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.mma_threads)
        return tiled_r2s, thr_r2s.partition_D(sC), rD_layout, c_pipe, epi_bar

    @cute.jit
    def _store(self, acc, tiled_r2s, tRS_sC, rD_layout, tma_c, sC, gC_tile, c_pipe, epi_bar, warp_idx):
        """Epilogue of one tile: registers -> own smem buffers -> TMA store, epi_tile at a time."""
        tRS_acc = tiled_r2s.retile(acc)
        rD = cute.make_rmem_tensor_like(rD_layout, self.acc_dtype)
        n_rd = cute.size(rD)
        gC_epi = cute.zipped_divide(gC_tile, self.epi_tile)
        bSG_s, bSG_g = cute.nvgpu.cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
        )
        epi_shape = gC_epi.shape[1]
        epi_order = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        for e in cutlass.range_constexpr(cute.size(gC_epi, mode=[1])):
            for v in cutlass.range_constexpr(n_rd):
                rD[v] = tRS_acc[e * n_rd + v]
            rOut = cute.make_rmem_tensor_like(rD_layout, self.c_dtype)
            rOut.store(rD.load().to(self.c_dtype))
            buf = e % self.epi_stage
            cute.copy(tiled_r2s, rOut, tRS_sC[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_bar.arrive_and_wait()
            if warp_idx == self.store_warp:
                cute.copy(tma_c, bSG_s[(None, buf)], bSG_g[(None, epi_order.get_hier_coord(e))])
                c_pipe.producer_commit()
                c_pipe.producer_acquire()
            epi_bar.arrive_and_wait()

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
        bid, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        acc_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        mmas = (tiled_mma, acc_mma)
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.ab_dtype, a_smem) + cute.size_in_bytes(self.ab_dtype, b_smem)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads // 32),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive()
        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)

        # (bM, bK, RestM, RestK, L), (bN, bK, RestN, RestK, E), (bM, bN, RestM, RestN, L)
        gA = cute.local_tile(mA, cute.slice_(self.tile_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        gC = cute.local_tile(mC, cute.slice_(self.tile_mnk, (None, None, 0)), (None, None, None))
        tiles_m = cute.size(gC, mode=[2])
        tiles_n = cute.size(gC, mode=[3])
        n_l = cute.size(gC, mode=[4])
        num_tiles = tiles_m * tiles_n * n_l
        k_tiles = cute.size(gA, mode=[3])
        sP = storage.prefix.get_tensor(cute.make_layout(self.n_prefix))
        sF = None
        if cutlass.const_expr(self.stage_scales):
            sF = storage.factors.get_tensor(cute.make_layout(self.n_factors))
        if cutlass.const_expr(self.compact):
            self._prefix(sP, aux, n_l, tiles_n, tidx, warp_idx)
            num_tiles = sP[n_l] * tiles_m
        else:
            pipeline.pipeline_init_wait()

        wg = cute.arch.make_warp_uniform(warp_idx // 4)
        if wg == 0:
            if cutlass.const_expr(not self.masked):  # the decode kernels need few registers (ptxas ignores it there)
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                one = cute.make_layout(1)
                tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                    tma_a, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
                )
                tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                    tma_b, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
                )
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
                for t in cutlass.range(bid, num_tiles, n_ctas, unroll=1):
                    pm, pn, pl, expert, active = self._tile(t, tiles_m, tiles_n, n_l, aux, sP)
                    if active:
                        tAgA_t = tAgA[(None, pm, None, pl)]
                        tBgB_t = tBgB[(None, pn, None, expert)]
                        prod.reset_count()  # prod.count = K tile index within this tile
                        if cutlass.const_expr(self.k_group > 1):
                            for g in cutlass.range(0, k_tiles, self.k_group, unroll=1):
                                prod = self._load_group(
                                    ab_pipe, prod, cutlass.min(self.k_group, k_tiles - g),
                                    tma_a, tAgA_t, tAsA, tma_b, tBgB_t, tBsB,
                                )
                        else:
                            for _ in cutlass.range(k_tiles, unroll=1):
                                prod = self._load(ab_pipe, prod, tma_a, tAgA_t, tAsA, tma_b, tBgB_t, tBsB)
                ab_pipe.producer_tail(prod)
        else:
            if cutlass.const_expr(not self.masked):
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - 128
            thr_mma = tiled_mma.get_slice(cute.make_layout(self.n_wg, stride=128)(wg - 1))
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            tCcC = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
            part0 = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
            part1 = cute.make_rmem_tensor(tCcC.shape if self.overlap else 1, self.acc_dtype)
            num_kb = cute.size(tCrA, mode=[2])

            tiled_r2s, tRS_sC, rD_layout, c_pipe, epi_bar = self._epilogue_setup(epi_mma, sC, ctid)
            factor_bar = pipeline.NamedBarrier(barrier_id=2, num_threads=self.mma_threads)

            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            f_cur = cute.make_rmem_tensor(tCcC.shape if self.prefetch else 1, self.acc_dtype)
            f_nxt = cute.make_rmem_tensor(tCcC.shape if self.prefetch else 1, self.acc_dtype)
            if cutlass.const_expr(self.prefetch):  # the first tile's first scales
                last = cutlass.max(num_tiles - 1, 0)
                qm, qn, ql, _, _ = self._tile(cutlass.min(bid, last), tiles_m, tiles_n, n_l, aux, sP)
                self._scales(mSA, mSB, tCcC, 0, qm, qn, ql, ql, f_cur)
            for t in cutlass.range(bid, num_tiles, n_ctas, unroll=1):
                pm, pn, pl, expert, active = self._tile(t, tiles_m, tiles_n, n_l, aux, sP)
                if active:
                    acc.fill(0.0)
                    if cutlass.const_expr(self.prefetch):
                        # the tile after this one (this one again if none), for the last step's prefetch
                        qm, qn, ql, _, _ = self._tile(cutlass.min(t + n_ctas, num_tiles - 1), tiles_m, tiles_n, n_l, aux, sP)
                        for kt in cutlass.range(k_tiles, unroll=1):
                            cons = self._mma(ab_pipe, cons, mmas, part0, tCrA, tCrB, num_kb, True)
                            same = cutlass.Int32(kt + 1 < k_tiles)  # 1: next K step of this tile, 0: next tile's first
                            self._scales(
                                mSA, mSB, tCcC, same * (kt + 1),
                                same * pm + (1 - same) * qm, same * pn + (1 - same) * qn,
                                same * pl + (1 - same) * ql, same * pl + (1 - same) * ql, f_nxt,
                            )
                            cute.nvgpu.warpgroup.wait_group(0)
                            rel = self._promote(ab_pipe, rel, acc, part0, f_cur)
                            f_cur.store(f_nxt.load())
                    elif cutlass.const_expr(self.overlap):
                        if cutlass.const_expr(self.stage_scales):
                            self._stage_factors(sF, mSA, mSB, k_tiles, pm, pn, pl, expert, ctid, factor_bar)
                        # branch-free pairs, so ptxas can prove which temporary each wait retires
                        cons = self._mma(ab_pipe, cons, mmas, part0, tCrA, tCrB, num_kb, True)
                        for j in cutlass.range((k_tiles - 1) // 2, unroll=1):
                            cons = self._mma(ab_pipe, cons, mmas, part1, tCrA, tCrB, num_kb, True)
                            f = self._scales(mSA, mSB, tCcC, 2 * j, pm, pn, pl, expert, sF=sF)
                            cute.nvgpu.warpgroup.wait_group(1)
                            rel = self._promote(ab_pipe, rel, acc, part0, f)
                            cons = self._mma(ab_pipe, cons, mmas, part0, tCrA, tCrB, num_kb, True)
                            f = self._scales(mSA, mSB, tCcC, 2 * j + 1, pm, pn, pl, expert, sF=sF)
                            cute.nvgpu.warpgroup.wait_group(1)
                            rel = self._promote(ab_pipe, rel, acc, part1, f)
                        if k_tiles % 2 == 0:
                            cons = self._mma(ab_pipe, cons, mmas, part1, tCrA, tCrB, num_kb, True)
                            f = self._scales(mSA, mSB, tCcC, k_tiles - 2, pm, pn, pl, expert, sF=sF)
                            cute.nvgpu.warpgroup.wait_group(1)
                            rel = self._promote(ab_pipe, rel, acc, part0, f)
                            f = self._scales(mSA, mSB, tCcC, k_tiles - 1, pm, pn, pl, expert, sF=sF)
                            cute.nvgpu.warpgroup.wait_group(0)
                            rel = self._promote(ab_pipe, rel, acc, part1, f)
                        else:
                            f = self._scales(mSA, mSB, tCcC, k_tiles - 1, pm, pn, pl, expert, sF=sF)
                            cute.nvgpu.warpgroup.wait_group(0)
                            rel = self._promote(ab_pipe, rel, acc, part0, f)
                    else:
                        for kt in cutlass.range(k_tiles, unroll=1):
                            cons = self._mma(ab_pipe, cons, mmas, part0, tCrA, tCrB, num_kb, True)
                            f = self._scales(mSA, mSB, tCcC, kt, pm, pn, pl, expert)
                            cute.nvgpu.warpgroup.wait_group(0)
                            rel = self._promote(ab_pipe, rel, acc, part0, f)

                    gC_t = gC[(None, None, pm, pn, pl)]
                    self._store(acc, tiled_r2s, tRS_sC, rD_layout, tma_c, sC, gC_t, c_pipe, epi_bar, warp_idx)
            if warp_idx == self.store_warp:
                c_pipe.producer_tail()


class GroupedGemmSm90WSPingPong(GroupedGemmSm90WS):
    """Contiguous FP8 kernel for the compute-bound prefill sizes: 128 x 256 CTA tiles, ping-pong issue.

    Each CTA tile is two 128 x 128 halves sharing one A tile (b_tiles = 2: a stage holds A and both
    B tiles, 48 KB, 4 stages): per K step the CTA loads 48 KB for 2 * 128^3 MACs instead of
    32 KB for 128^3, so L2 -> SM traffic per FLOP drops by a quarter. Each consumer warpgroup owns
    64 rows x 256 columns: two 64 x 128 accumulators and one temporary (192 fp32 registers; a
    second temporary for the overlapped promotion would not fit in 232). Per K step a warpgroup
    issues the wgmmas of half 0, promotes them into acc0, issues half 1, promotes into acc1, every
    wait retiring the only outstanding group (no C7514). The two warpgroups take turns to issue
    (named barriers 2 and 3, ordered WG1 h0, WG2 h0, WG1 h1, WG2 h1, ...): the tensor cores run
    the issues in that order, so one warpgroup's wgmma chain runs while the other waits for its
    own and promotes, instead of both promoting at once with the tensor cores idle
    (ordered=False drops the turns, leaving the interleaving to the hardware: the A/B measurement).
    The promotion is exact as in the other variants: once per 128-wide K step with
    a_scale[row, k] * b_scale[n block, k], the B block of each half its own. An odd count of
    128-column tiles leaves the last pair with one half: its second half re-reads a valid B tile
    and is not stored. Rows per expert are padded to 128 (the contiguous layout's TILE_M).
    epi_buffers, prefetch_scales (and cluster=2, GroupedGemmSm90WSCluster): the prefill options of the
    module docstring."""

    def __init__(
        self, masked: bool = False, ordered: bool = True, epi_buffers: int | None = None, prefetch_scales: bool = False
    ):
        if masked:
            raise ValueError(f"masked={masked}: the ping-pong kernel is for the contiguous layout only")
        super().__init__(masked=False, n_wg=2, tile_n=SCALE_BLOCK)
        self.b_tiles = 2
        self.ordered, self.cluster, self.epi_buffers = ordered, 1, epi_buffers
        self.prefetch_scales = prefetch_scales

    @cute.jit
    def _tile(self, t, tiles_m, tiles_n, n_l, aux, sP):
        """Linear tile index -> (m tile, pair of n tiles, batch 0, expert, active); pairs innermost."""
        pairs = (tiles_n + 1) // 2
        pn = t % pairs
        pm = t // pairs
        expert = aux[pm]
        return pm, pn, cutlass.Int32(0), expert, expert >= 0

    def _issue(self, mmas, part, tCrA, tCrB, a_stage, b_stage, num_kb, my_turn, pass_turn):
        """The wgmmas of one 128-wide K step of one half into the temporary `part` (overwritten),
        issued in this warpgroup's turn if ordered."""
        if cutlass.const_expr(self.ordered):
            my_turn.arrive_and_wait()
        cute.nvgpu.warpgroup.fence()
        for kb in range(num_kb):
            mma = mmas[0] if kb == 0 else mmas[1]
            cute.gemm(mma, part, tCrA[(None, None, kb, a_stage)], tCrB[(None, None, kb, b_stage)], part)
        cute.nvgpu.warpgroup.commit_group()
        if cutlass.const_expr(self.ordered):
            pass_turn.arrive()

    def _row_slots(self, tCcC):
        """prefetch_scales: the distinct tile rows of a thread's accumulator fragment (2 for a 64-row wgmma
        slice), from the fragment's static layout: (a representative element per row, row slot per element)."""
        offs = [cute.get(tCcC.layout(i), mode=[0]) for i in range(cute.size(tCcC))]
        rows = sorted(set(offs))
        return [offs.index(r) for r in rows], [rows.index(o) for o in offs]

    @cute.jit
    def _load_scales(self, mSA, mSB, tCcC, fa, sb, j, kt, pm, nb0, nb1, expert):
        """prefetch_scales: slot j (0: the K step in progress, 1: the next) of fa (one A-row scale per
        distinct row of the thread's fragment) and sb (B-block scales of n tiles nb0 / nb1, expert
        `expert`) = the scales of m tile pm, K tile kt."""
        m0 = pm * self.tile_m
        reps, _ = self._row_slots(tCcC)
        for r, i in enumerate(reps):
            fa[j * len(reps) + r] = mSA[(m0 + tCcC[i][0], kt, 0)]
        sb[2 * j] = mSB[(nb0, kt, expert)]
        sb[2 * j + 1] = mSB[(nb1, kt, expert)]

    @cute.jit
    def _mainloop_prefetched(
        self, ab_pipe, cons, mmas, part, acc0, acc1, tCrA, tCrB, num_kb, my_turn, pass_turn,
        mSA, mSB, tCcC, fa, sb, t, pre_t, pm, pn, nb1, expert, k_tiles, tiles_m, tiles_n, num_tiles, n_ctas, aux, rank,
    ):
        """The K loop of one tile with the scales of each K step loaded one step ahead (prefetch_scales):
        while the wgmmas of step kt run, the consumers load the scales of step kt + 1, or on the last
        step those of the first step of this CTA's next tile when it is active (this tile's first step
        otherwise: an in-bounds load nobody uses), so a promotion never waits on a global load. The
        first tile, and one that follows an unused (-1) tile, loads its first step's scales up front.
        Cluster kernels: tiles are the cluster walk's units (the m tile whose operands this CTA loads).
        Returns (consumer state, the tile whose first-step scales fa[0] / sb[0] now hold, or -1)."""
        reps, slot = self._row_slots(tCcC)
        n_rows = len(reps)
        if pre_t != t:
            self._load_scales(mSA, mSB, tCcC, fa, sb, 0, 0, pm, 2 * pn, nb1, expert)
        tn = t + n_ctas
        if cutlass.const_expr(self.cluster > 1):
            qm, qn, qe, qa, _, _ = self._unit(cutlass.min(tn, num_tiles - 1), tiles_m, tiles_n, aux, rank)
        else:
            qm, qn, _, qe, qa = self._tile(cutlass.min(tn, num_tiles - 1), tiles_m, tiles_n, 1, aux, None)
        nxt = cutlass.Int32(tn < num_tiles) * cutlass.Int32(qa)  # 1: the next tile is real and active
        qb1 = cutlass.min(2 * qn + 1, tiles_n - 1)
        for kt in cutlass.range(k_tiles, unroll=1):
            ab_pipe.consumer_wait(cons)
            self._issue(mmas, part, tCrA, tCrB, cons.index, 2 * cons.index, num_kb, my_turn, pass_turn)
            same = cutlass.Int32(kt + 1 < k_tiles)  # 1: step kt + 1 of this tile, 0: a first step
            go = (1 - same) * nxt  # 1: the next tile's first step
            self._load_scales(
                mSA, mSB, tCcC, fa, sb, 1, same * (kt + 1),
                pm + go * (qm - pm), 2 * pn + go * (2 * qn - 2 * pn), nb1 + go * (qb1 - nb1), expert + go * (qe - expert),
            )
            cute.nvgpu.warpgroup.wait_group(0)
            f = [fa[r] * sb[0] for r in range(n_rows)]
            for i, r in enumerate(slot):  # unrolled at trace time (slot: one row slot per element)
                acc0[i] = acc0[i] + part[i] * f[r]
            self._issue(mmas, part, tCrA, tCrB, cons.index, 2 * cons.index + 1, num_kb, my_turn, pass_turn)
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipe.consumer_release(cons)
            cons.advance()
            f = [fa[r] * sb[1] for r in range(n_rows)]
            for i, r in enumerate(slot):
                acc1[i] = acc1[i] + part[i] * f[r]
            for r in cutlass.range_constexpr(n_rows):
                fa[r] = fa[n_rows + r]
            sb[0] = sb[2]
            sb[1] = sb[3]
        pre = cutlass.Int32(-1)
        if nxt == 1:
            pre = tn
        return cons, pre

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
        bid, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        acc_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        mmas = (tiled_mma, acc_mma)
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.ab_dtype, a_smem) + 2 * cute.size_in_bytes(self.ab_dtype, b_smem)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # cluster: every consumer warp releases a stage in both CTAs (the peer multicasts into it)
        cl_shape = cute.make_layout((self.cluster, 1))
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster * self.mma_threads // 32),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster, 1, 1)),
            defer_sync=True,
        )
        if cutlass.const_expr(self.cluster > 1):
            pipeline.pipeline_init_arrive(cluster_shape_mn=cl_shape, is_relaxed=True)
        else:
            pipeline.pipeline_init_arrive()
        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)

        # (bM, bK, RestM, RestK, 1), (bN, bK, RestN, RestK, E), (bM, bN, RestM, RestN, 1); 128 x 128 tiles
        gA = cute.local_tile(mA, cute.slice_(self.tile_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        gC = cute.local_tile(mC, cute.slice_(self.tile_mnk, (None, None, 0)), (None, None, None))
        tiles_m = cute.size(gC, mode=[2])
        tiles_n = cute.size(gC, mode=[3])
        num_tiles = tiles_m * ((tiles_n + 1) // 2)
        k_tiles = cute.size(gA, mode=[3])
        rank = cutlass.Int32(0)
        if cutlass.const_expr(self.cluster > 1):  # the walk goes over units (pairs of m tiles) per cluster
            num_tiles = ((tiles_m + 1) // 2) * ((tiles_n + 1) // 2)
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            bid = bid // 2
            n_ctas = n_ctas // 2
            pipeline.pipeline_init_wait(cluster_shape_mn=cl_shape)
        else:
            pipeline.pipeline_init_wait()

        wg = cute.arch.make_warp_uniform(warp_idx // 4)
        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                one = cute.make_layout(1)
                tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                    tma_a, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
                )
                tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                    tma_b, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
                )
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
                for t in cutlass.range(bid, num_tiles, n_ctas, unroll=1):
                    if cutlass.const_expr(self.cluster > 1):
                        pm, pn, expert, active, mc, _ = self._unit(t, tiles_m, tiles_n, aux, rank)
                    else:
                        pm, pn, _, expert, active = self._tile(t, tiles_m, tiles_n, 1, aux, None)
                    if active:
                        tAgA_t = tAgA[(None, pm, None, 0)]
                        tBgB_0 = tBgB[(None, 2 * pn, None, expert)]
                        tBgB_1 = tBgB[(None, cutlass.min(2 * pn + 1, tiles_n - 1), None, expert)]
                        for kt in cutlass.range(k_tiles, unroll=1):
                            ab_pipe.producer_acquire(prod)
                            bar = ab_pipe.producer_get_barrier(prod)
                            cute.copy(tma_a, tAgA_t[(None, kt)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                            if cutlass.const_expr(self.cluster > 1):
                                self._load_b_pair(tma_b, tBgB_0, tBgB_1, tBsB, kt, prod.index, bar, mc, rank)
                            else:
                                cute.copy(tma_b, tBgB_0[(None, kt)], tBsB[(None, 2 * prod.index)], tma_bar_ptr=bar)
                                cute.copy(tma_b, tBgB_1[(None, kt)], tBsB[(None, 2 * prod.index + 1)], tma_bar_ptr=bar)
                            ab_pipe.producer_commit(prod)
                            prod.advance()
                ab_pipe.producer_tail(prod)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - 128
            thr_mma = tiled_mma.get_slice(cute.make_layout(self.n_wg, stride=128)(wg - 1))
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            tCcC = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            acc0 = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
            acc1 = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
            part = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
            num_kb = cute.size(tCrA, mode=[2])
            tiled_r2s, tRS_sC, rD_layout, c_pipe, epi_bar = self._epilogue_setup(epi_mma, sC, ctid)
            # the issue turn: WG1 waits on barrier 3 and passes on 2, WG2 the reverse; WG2 starts
            # with a pass (WG1 issues first) and WG1 ends with a wait (every arrival consumed)
            my_turn = pipeline.NamedBarrier(barrier_id=4 - wg, num_threads=self.mma_threads)
            pass_turn = pipeline.NamedBarrier(barrier_id=1 + wg, num_threads=self.mma_threads)
            if cutlass.const_expr(self.ordered):
                if wg == 2:
                    pass_turn.arrive()

            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            # prefetch_scales: fa / sb hold the A-row / B-block scales of the K step in progress (slot 0) and
            # of the next (slot 1); pre_t names the tile whose first step slot 0 holds (-1: none)
            n_fa = 2 * len(self._row_slots(tCcC)[0]) if self.prefetch_scales else 1
            fa = cute.make_rmem_tensor(n_fa, self.acc_dtype)
            sb = cute.make_rmem_tensor(4 if self.prefetch_scales else 1, self.acc_dtype)
            pre_t = cutlass.Int32(-1)
            for t in cutlass.range(bid, num_tiles, n_ctas, unroll=1):
                store = True
                pl = cutlass.Int32(0)
                if cutlass.const_expr(self.cluster > 1):
                    pm, pn, expert, active, _, store = self._unit(t, tiles_m, tiles_n, aux, rank)
                else:
                    pm, pn, pl, expert, active = self._tile(t, tiles_m, tiles_n, 1, aux, None)
                if active:
                    acc0.fill(0.0)
                    acc1.fill(0.0)
                    nb1 = cutlass.min(2 * pn + 1, tiles_n - 1)
                    if cutlass.const_expr(self.prefetch_scales):
                        cons, pre_t = self._mainloop_prefetched(
                            ab_pipe, cons, mmas, part, acc0, acc1, tCrA, tCrB, num_kb, my_turn, pass_turn,
                            mSA, mSB, tCcC, fa, sb, t, pre_t, pm, pn, nb1, expert, k_tiles, tiles_m, tiles_n,
                            num_tiles, n_ctas, aux, rank,
                        )
                    else:
                        for kt in cutlass.range(k_tiles, unroll=1):
                            ab_pipe.consumer_wait(cons)
                            self._issue(mmas, part, tCrA, tCrB, cons.index, 2 * cons.index, num_kb, my_turn, pass_turn)
                            f = self._scales(mSA, mSB, tCcC, kt, pm, 2 * pn, pl, expert)
                            cute.nvgpu.warpgroup.wait_group(0)
                            for i in range(cute.size(acc0)):
                                acc0[i] = acc0[i] + part[i] * f[i]
                            self._issue(mmas, part, tCrA, tCrB, cons.index, 2 * cons.index + 1, num_kb, my_turn, pass_turn)
                            f = self._scales(mSA, mSB, tCcC, kt, pm, nb1, pl, expert)
                            cute.nvgpu.warpgroup.wait_group(0)
                            ab_pipe.consumer_release(cons)
                            cons.advance()
                            for i in range(cute.size(acc1)):
                                acc1[i] = acc1[i] + part[i] * f[i]
                    epi = (tiled_r2s, tRS_sC, rD_layout, tma_c, sC)
                    if store:
                        self._store(acc0, *epi, gC[(None, None, pm, 2 * pn, 0)], c_pipe, epi_bar, warp_idx)
                        if 2 * pn + 1 < tiles_n:
                            self._store(acc1, *epi, gC[(None, None, pm, 2 * pn + 1, 0)], c_pipe, epi_bar, warp_idx)
            if cutlass.const_expr(self.ordered):
                if wg == 1:
                    my_turn.arrive_and_wait()
            if warp_idx == self.store_warp:
                c_pipe.producer_tail()
        if cutlass.const_expr(self.cluster > 1):  # no CTA leaves while its peer may still signal it
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()


class GroupedGemmSm90WSCluster(GroupedGemmSm90WSPingPong):
    """The 128 x 256 kernel on clusters of 2 CTAs along M (cluster=2 of the module docstring), launched
    over a grid the host sizes: one more argument after `aux`, `clusters`, the number of 2-CTA
    clusters that are co-resident on the device (moe.occupancy.max_active_clusters; it can be below
    SMs / 2 when a GPC has an odd count of free SMs). The grid is 2 * min(units, clusters) CTAs, so
    every cluster starts at once and the persistent walk strides by the clusters launched (a cluster
    that had to wait for a free pair of SMs would run its whole share of units as a second wave)."""

    def __init__(
        self, masked: bool = False, ordered: bool = True, epi_buffers: int | None = None, prefetch_scales: bool = False
    ):
        super().__init__(masked=masked, ordered=ordered, epi_buffers=epi_buffers, prefetch_scales=prefetch_scales)
        self.cluster = 2

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        c: cute.Tensor,
        a_scale: cute.Tensor,
        b_scale: cute.Tensor,
        aux: cute.Tensor,
        clusters: cutlass.Int32,
        pdl: cutlass.Int32,
        stream,
    ):
        """Pairs of CTAs (a cluster of 2 along M) over pairs of 128-row tiles: B through multicast TMA."""
        self._setup()
        a_scale, b_scale, c, tma_a, tma_ta, _, _, tma_c, tma_tc = self._operands(a, b, c, a_scale, b_scale)
        b = cute.make_tensor(cute.recast_ptr(b.iterator, dtype=self.ab_dtype), b.layout)
        tma_b, tma_tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), b,
            cute.slice_(self.b_smem_staged, (None, None, 0)), (self.tile_mnk[1], self.tile_mnk[2]), num_multicast=1,
        )
        tiles_m = cute.ceil_div(cute.size(c, mode=[0]), self.tile_m)
        pairs = cute.ceil_div(cute.ceil_div(cute.size(c, mode=[1]), self.tile_n), 2)
        units = cute.ceil_div(tiles_m, 2) * pairs

        self.shared_storage = self._shared_storage(factors=False)
        self.kernel(
            tma_a, tma_ta, tma_b, tma_tb, tma_c, tma_tc, a_scale, b_scale, aux,
            self.tiled_mma, self.tiled_mma, self.tiled_mma,
            self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
        ).launch(
            grid=(2 * cutlass.max(cutlass.min(units, clusters), 1), 1, 1), block=[self.threads, 1, 1],
            cluster=(2, 1, 1), stream=stream, use_pdl=pdl,
        )

    @cute.jit
    def _unit(self, t, tiles_m, tiles_n, aux, rank):
        """Cluster walk: unit t -> (m tile, pair of n tiles, expert of the loads, active, multicast, store).

        The two CTAs of a cluster take m tiles 2q and 2q + 1 of unit (q, pair), pairs innermost. Both
        must run the same pipeline steps, so a unit is active if either tile is; a CTA whose tile is
        past the end or unused (-1) loads its partner's operands and stores nothing. B is multicast
        when both tiles load the same expert's weights (not across an expert boundary)."""
        pairs = (tiles_n + 1) // 2
        pn = t % pairs
        q = t // pairs
        pm = 2 * q + rank
        e_own = aux[cutlass.min(pm, tiles_m - 1)]
        e_peer = aux[cutlass.min(2 * q + 1 - rank, tiles_m - 1)]
        if pm >= tiles_m:
            e_own = cutlass.Int32(-1)
        if 2 * q + 1 - rank >= tiles_m:
            e_peer = cutlass.Int32(-1)
        store = e_own >= 0
        e_load = e_own
        if e_own < 0:
            e_load = e_peer
        e_peer_load = e_peer
        if e_peer < 0:
            e_peer_load = e_own
        pm_load = pm
        if e_own < 0:
            pm_load = 2 * q + 1 - rank
        return pm_load, pn, e_load, e_load >= 0, e_load == e_peer_load, store

    @cute.jit
    def _load_b_pair(self, tma_b, tBgB_0, tBgB_1, tBsB, kt, index, bar, mc, rank):
        """Cluster: the B tiles of one stage. Multicast: each CTA loads the half of its rank into both
        CTAs; across an expert boundary each CTA loads both halves for itself."""
        both = cutlass.Int16(3)
        own = cutlass.Int16(1 + rank)  # rank 0 -> 0b01, rank 1 -> 0b10
        if mc:
            if rank == 0:
                cute.copy(tma_b, tBgB_0[(None, kt)], tBsB[(None, 2 * index)], tma_bar_ptr=bar, mcast_mask=both)
            else:
                cute.copy(tma_b, tBgB_1[(None, kt)], tBsB[(None, 2 * index + 1)], tma_bar_ptr=bar, mcast_mask=both)
        else:
            cute.copy(tma_b, tBgB_0[(None, kt)], tBsB[(None, 2 * index)], tma_bar_ptr=bar, mcast_mask=own)
            cute.copy(tma_b, tBgB_1[(None, kt)], tBsB[(None, 2 * index + 1)], tma_bar_ptr=bar, mcast_mask=own)


VARIANTS = {
    "ws_fp8_contig": dict(masked=False, overlap=True),
    "ws_fp8_contig_serial": dict(masked=False),
    # prefill, compute-bound sizes: 128 x 256 tiles, the two consumer warpgroups take turns to issue
    "ws_fp8_contig_pingpong": dict(masked=False, cls=GroupedGemmSm90WSPingPong),
    "ws_fp8_contig_n256": dict(masked=False, ordered=False, cls=GroupedGemmSm90WSPingPong),  # same, no turns
    # _n256 with 4 epilogue buffers (32 KB: 4 A/B stages still fit), so a tile's TMA stores rarely wait
    "ws_fp8_contig_n256_e4": dict(masked=False, ordered=False, epi_buffers=4, cls=GroupedGemmSm90WSPingPong),
    # _n256_e4 on clusters of 2 CTAs along M: each CTA loads half of the shared B tile and multicasts it
    # (the host passes the co-resident cluster count after aux: GroupedGemmSm90WSCluster)
    "ws_fp8_contig_n256_mc": dict(masked=False, ordered=False, epi_buffers=4, cls=GroupedGemmSm90WSCluster),
    # _n256_mc with the 2 epilogue buffers of _n256 (at 16384 tokens _e4 was slower than _n256 by 2-6%)
    "ws_fp8_contig_n256_mc_e2": dict(masked=False, ordered=False, cls=GroupedGemmSm90WSCluster),
    # _n256 with each K step's scale factors loaded one step ahead (prefetch_scales), across tiles too
    "ws_fp8_contig_n256_sp": dict(masked=False, ordered=False, prefetch_scales=True, cls=GroupedGemmSm90WSPingPong),
    # both: _n256_mc_e2 with prefetch_scales
    "ws_fp8_contig_n256_mc_e2_sp": dict(masked=False, ordered=False, prefetch_scales=True, cls=GroupedGemmSm90WSCluster),
    "ws_fp8_masked_swapab": dict(masked=True, n_wg=2, tile_n=32),
    "ws_fp8_masked_swapab_m64n16": dict(masked=True, n_wg=1, tile_n=16),
    # decode: compact walk + scale prefetch (module docstring); 128 and 64 weight rows per tile
    "ws_fp8_masked_swapab_cp": dict(masked=True, n_wg=2, tile_n=32, compact=True, prefetch=True),
    "ws_fp8_masked_swapab_m64n32_cp": dict(masked=True, n_wg=1, tile_n=32, compact=True, prefetch=True),
    "ws_fp8_masked_swapab_m64n16_cp": dict(masked=True, n_wg=1, tile_n=16, compact=True, prefetch=True),
    # compact walk with the overlapped promotion instead of the prefetch
    "ws_fp8_masked_swapab_cpo": dict(masked=True, n_wg=2, tile_n=32, compact=True, overlap=True),
    # _cpo with the producer requesting 2 or 4 K tiles at once (256 / 512 contiguous bytes per weight row)
    "ws_fp8_masked_swapab_cpo_kg2": dict(masked=True, n_wg=2, tile_n=32, compact=True, overlap=True, k_group=2),
    "ws_fp8_masked_swapab_cpo_kg4": dict(masked=True, n_wg=2, tile_n=32, compact=True, overlap=True, k_group=4),
    # few tokens: _cpo with each tile's promotion factors staged in shared memory (stage_scales), on
    # 128- and 64-row weight tiles (64: twice the tiles, so a handful of experts spreads over more SMs)
    "ws_fp8_masked_swapab_cps": dict(masked=True, n_wg=2, tile_n=32, compact=True, overlap=True, stage_scales=True),
    "ws_fp8_masked_swapab_m64n32_cps": dict(
        masked=True, n_wg=1, tile_n=32, compact=True, overlap=True, stage_scales=True
    ),
    "ws_fp8_masked_swapab_m64n16_cps": dict(
        masked=True, n_wg=1, tile_n=16, compact=True, overlap=True, stage_scales=True
    ),
}


def compile_for_export(arch: str = "sm_90a") -> dict:
    """{export name: compiled fn} for every entry of VARIANTS (arguments as in sm90_grouped_gemm; the
    cluster variants take the co-resident cluster count after aux, then pdl: GroupedGemmSm90WSCluster)."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch={arch!r}: the wgmma grouped GEMM needs sm_90a")
    kernels = {}
    for name, kw in VARIANTS.items():
        kw = dict(kw)
        cls = kw.pop("cls", GroupedGemmSm90WS)
        kernels[name] = _export(cls(**kw), True, kw["masked"], arch, issubclass(cls, GroupedGemmSm90WSCluster))
    return kernels
