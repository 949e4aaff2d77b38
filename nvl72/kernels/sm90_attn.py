"""One-token split-key paged attention for Hopper in CuTeDSL: a batch-1 decode step's q/k RMSNorm + RoPE,
the new key and value's store and the attention over one split of the keys, with the results
nvl72.model.fused_triton's split decode (attend_block with NORM, EARLY and LEAVE) leaves: the
output where one split holds the keys, the splits' partials where 2 to LEAVE do (o_proj's kernel,
nvl72.kernels.sm90_gemv's attn variants, combines them), else the partials combined by the last
split to arrive.

Why (H200, %globaltimer stamps inside both kernels and 48-layer batch-1 steps, perf/RESULTS.md
2026-11-29): Triton's program ([16, 128] tiles through tl.dot, 8 warps) spent 4.3 us after its PDL
wait on ~0.6 us of loads: 1.6 us to the normed, roped q, 1.5 more for a 64-key block's scores,
softmax and values, 1.2 for the partials. Here a warp holds one query head, lane l its dims
4l .. 4l + 3: the norms are warp sums, RoPE's partner dims one shuffle away (lane l ^ 16), no CTA
barrier between the wait and the partials' stores. With 8 heads a CTA the scores and values still
took 1.1 + 1.5 us (two warps a scheduler, the values a key a step) and the step was no faster (1.658
against Triton's 1.664 ms at contexts to 192 keys, 1.697 against 1.689 at 384-448 keys); 4 heads a
CTA 1.648 / 1.678, 2 heads 1.641 / 1.678; 2 heads with the values' loads grouped (PV_KEYS) 1.643
against 1.665 and 1.672 against 1.689. The step gains less than the attention's own time: o_proj's
weight stream, started at the same wait, ends about when the attention does.

CTA (split, KV head, part), a warp per query head of the part's `heads_per_cta`. Before the PDL wait
(the q/k/v projection writes only q, k and v): the split's first block of BLOCK_N keys is bulk-copied
from its pages into shared memory (one thread, a copy per page run; the new key's slot comes along
stale and is replaced), the norm weights and the token's cos/sin rows are loaded. After it: q, k and
v rows, the norms and RoPE in registers (every warp computes the key: no barrier), the split holding
the new key stores it and v to their page slot (part 0), and each warp writes them into its block's
row. Scores: lane l takes keys l and l + 32, reading its key rows in 16-byte pieces rotated by lane
(conflict-free) against q staged per warp in fp32 (the pieces' halves 256 bytes apart: conflict-free
too); softmax by warp max / sum; p rounded to bf16 as tl.dot's operand is; values: lane l's dims over
the block's keys, PV_KEYS keys' loads at a time. Longer splits walk more blocks (online softmax, the
next block copied after a CTA barrier).
Arguments (flat torch views, one token of one sequence): (q [Hq * D], k [Hkv * D], v [Hkv * D],
q_w [D], k_w [D], cos [D], sin [D] (bf16), slot [1] int64, seq_lens [1] int32, page_table row int32,
kv_cache (bf16, contiguous [pages, 2, Hkv, page_size, D]), out [Hq * D] bf16, part_acc
[Hq * splits * D] bf16, part_ml [Hq * splits * 2] fp32, counters [>= Hq] int32 (zero between
launches: the combining split resets its own); splits, page_size, Hkv, scale (fp32), eps (fp32),
pdl). The grid is (splits, Hkv, group / heads_per_cta).
"""
import cutlass
import cutlass.cute as cute

from aot.build import fake_args
from aot.ptx import (atomic_add_acq_rel, bulk_g2s, fence_proxy_async_shared, ld_global_bf16x4, ld_global_f32,
                     ld_shared_bf16x4, ld_shared_bf16x8, ld_shared_f32, ld_shared_v4f, st_global_bf16x4,
                     st_global_relaxed_i32, st_shared_bf16x4, st_shared_v4f)
from aot.rows import bf16_round, lanes_reduce, warp_sum
from nvl72.kernels.sm90_gemv import LEAVE

ARCHS = ("sm_90a",)
BLOCK_N = 64  # keys a block (fused_triton.key_block(128): the split arithmetic must match o_proj's)
D = 128  # head_dim: 4 dims a lane
COMBINE_ROUND = 8  # partials loaded together in the last split's combine
PV_KEYS = 8  # keys whose p and value rows are loaded together in the value loop
# Qwen3-30B-A3B: 8 query heads a KV head, plain RMSNorm weights, full-width RoPE; 2 heads a CTA
VARIANTS = {"attn_one_token_g8_d128": dict(group=8, heads_per_cta=2)}


class AttnOneToken:
    """One compiled variant: the query heads a KV head, the heads a CTA takes (a warp each) and LEAVE (the
    partials the consumer combines). Plain RMSNorm weights only (zero-centred ones come with gated heads,
    Qwen3-Next, whose steps run Triton's). See the module docstring."""

    def __init__(self, group: int, heads_per_cta: int, leave: int = LEAVE):
        if group < 1 or heads_per_cta < 1 or group % heads_per_cta or leave < 2:
            raise ValueError(f"group={group}, heads_per_cta={heads_per_cta}, leave={leave}: heads_per_cta must "
                             "divide the query heads a KV head, leave be at least 2")
        self.group, self.hpc, self.leave = group, heads_per_cta, leave
        self.threads = 32 * heads_per_cta

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, q_w: cute.Tensor, k_w: cute.Tensor,
                 cos: cute.Tensor, sin: cute.Tensor, slot: cute.Tensor, seq_lens: cute.Tensor, page_row: cute.Tensor,
                 kv_cache: cute.Tensor, out: cute.Tensor, part_acc: cute.Tensor, part_ml: cute.Tensor,
                 counters: cute.Tensor, splits: cutlass.Int32, page_size: cutlass.Int32, hkv: cutlass.Int32,
                 scale: cutlass.Float32, eps: cutlass.Float32, pdl: cutlass.Int32, stream):
        hpc = self.hpc

        @cute.struct
        class Storage:
            bar: cute.struct.MemRange[cutlass.Int64, 1]  # the K/V block's bulk copies
            k: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BLOCK_N * D], 128]
            v: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BLOCK_N * D], 128]
            q: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, hpc * D], 128]  # a warp's roped q
            p: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, hpc * BLOCK_N], 16]  # a warp's p
            last: cute.struct.MemRange[cutlass.Int32, 1]  # the combine's arrival count

        self.storage = Storage
        self.kernel(q, k, v, q_w, k_w, cos, sin, slot, seq_lens, page_row, kv_cache, out, part_acc, part_ml, counters,
                    splits, page_size, hkv, scale, eps).launch(
            grid=[splits, hkv, self.group // hpc], block=[self.threads, 1, 1], stream=stream, use_pdl=pdl)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, q_w: cute.Tensor, k_w: cute.Tensor,
               cos: cute.Tensor, sin: cute.Tensor, slot: cute.Tensor, seq_lens: cute.Tensor, page_row: cute.Tensor,
               kv_cache: cute.Tensor, out: cute.Tensor, part_acc: cute.Tensor, part_ml: cute.Tensor,
               counters: cute.Tensor, splits: cutlass.Int32, page_size: cutlass.Int32, hkv: cutlass.Int32,
               scale: cutlass.Float32, eps: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        split, kvh, part = cute.arch.block_idx()
        seq_len = seq_lens[0]
        chunk = cutlass.max(((seq_len + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N)
        active = cutlass.max((seq_len + chunk - 1) // chunk, 1)
        if split < active:  # (the splits past the keys end at once: nothing to read or write)
            storage = cutlass.utils.SmemAllocator().allocate(self.storage)
            bar = storage.bar.data_ptr()
            k_s, v_s = storage.k.data_ptr().toint(), storage.v.data_ptr().toint()
            q_s, p_s = storage.q.data_ptr().toint(), storage.p.data_ptr().toint()
            w, lane = tidx // 32, tidx % 32
            lo = split * chunk
            hi = cutlass.min(seq_len, lo + chunk)
            head_stride = page_size * D  # elements: [pages, 2, Hkv, page_size, D]
            kind_stride = hkv * head_stride
            cache = kv_cache.iterator.toint()
            if tidx == 0:
                cute.arch.mbarrier_init(bar, 1)
                cute.arch.mbarrier_init_fence()
                self._ask_block(cache, page_row, k_s, v_s, bar, lo, cutlass.min(hi - lo, BLOCK_N), page_size, kvh,
                                head_stride, kind_stride)
            qw = ld_global_bf16x4(q_w.iterator.toint() + lane * 8)
            kw = ld_global_bf16x4(k_w.iterator.toint() + lane * 8)
            c = ld_global_bf16x4(cos.iterator.toint() + lane * 8)
            s = ld_global_bf16x4(sin.iterator.toint() + lane * 8)
            new_slot = slot[0]
            cute.arch.sync_threads()  # the mbarrier is initialised
            cute.arch.griddepcontrol_wait()  # q, k and v are complete and visible
            cute.arch.griddepcontrol_launch_dependents()
            head = kvh * self.group + part * self.hpc + w
            xq = ld_global_bf16x4(q.iterator.toint() + cutlass.Int64(head * D + lane * 4) * 2)
            xk = ld_global_bf16x4(k.iterator.toint() + cutlass.Int64(kvh * D + lane * 4) * 2)
            xv = ld_global_bf16x4(v.iterator.toint() + cutlass.Int64(kvh * D + lane * 4) * 2)
            qn = self._norm_rope(xq, qw, c, s, lane, eps)
            kn = self._norm_rope(xk, kw, c, s, lane, eps)
            q_w_s = q_s + w * D * 4
            st_shared_v4f(q_w_s + lane % 2 * (D * 2) + lane // 2 * 16, qn)  # dims 8j .. 8j + 7: j*16 and 256 + j*16
            if (split == active - 1) & (part == 0) & (w == 0) & (new_slot >= 0):
                dst = cache + (new_slot // page_size * 2 * kind_stride + kvh * head_stride
                               + new_slot % page_size * D + lane * 4) * 2
                st_global_bf16x4(dst, kn)
                st_global_bf16x4(dst + kind_stride * 2, xv)
            m_i = -cutlass.Float32.inf
            l_i = cutlass.Float32(0.0)
            acc = [cutlass.Float32(0.0) for _ in range(4)]
            p_w_s = p_s + w * BLOCK_N * 4
            p_w = storage.p.get_tensor(cute.make_layout(self.hpc * BLOCK_N))  # (written here, read at p_w_s)
            phase = cutlass.Int32(0)
            for start in cutlass.range(lo, hi, BLOCK_N, unroll=1):
                nk = cutlass.min(hi - start, BLOCK_N)
                if start > lo:  # every warp is done with the last block
                    cute.arch.sync_threads()
                    if tidx == 0:
                        fence_proxy_async_shared()
                        self._ask_block(cache, page_row, k_s, v_s, bar, start, nk, page_size, kvh, head_stride,
                                        kind_stride)
                cute.arch.mbarrier_wait(bar, phase)
                phase ^= 1
                fresh = seq_len - 1 - start  # the new key's row in this block (it came stale)
                if (fresh >= 0) & (fresh < nk):
                    st_shared_bf16x4(k_s + fresh * D * 2 + lane * 8, kn)
                    st_shared_bf16x4(v_s + fresh * D * 2 + lane * 8, xv)
                cute.arch.sync_warp()
                s0, s1 = self._scores(q_w_s, k_s, lane)
                s0 = cutlass.select_(lane < nk, s0 * scale, -cutlass.Float32.inf)
                s1 = cutlass.select_(lane + 32 < nk, s1 * scale, -cutlass.Float32.inf)
                m_new = cutlass.max(m_i, lanes_reduce(cutlass.max(s0, s1), 32, cutlass.max))
                alpha = cute.math.exp(m_i - m_new, fastmath=True)
                p0 = cute.math.exp(s0 - m_new, fastmath=True)
                p1 = cute.math.exp(s1 - m_new, fastmath=True)
                l_i = l_i * alpha + warp_sum(p0 + p1)
                m_i = m_new
                p_w[w * BLOCK_N + lane] = bf16_round(p0)
                p_w[w * BLOCK_N + lane + 32] = bf16_round(p1)
                cute.arch.sync_warp()
                acc = [a * alpha for a in acc]
                for n0 in cutlass.range(0, nk - PV_KEYS + 1, PV_KEYS, unroll=1):  # whole groups
                    acc = self._values(acc, p_w_s, v_s, n0, PV_KEYS, lane)
                for n in cutlass.range(nk - nk % PV_KEYS, nk, unroll=1):  # the rest, a key at a time
                    acc = self._values(acc, p_w_s, v_s, n, 1, lane)
            o = [a / l_i for a in acc]
            head_out = out.iterator.toint() + cutlass.Int64(head * D + lane * 4) * 2
            if active == 1:
                st_global_bf16x4(head_out, o)
            else:
                prow = head * splits + split
                st_global_bf16x4(part_acc.iterator.toint() + cutlass.Int64(prow * D + lane * 4) * 2, o)
                if lane == 0:
                    part_ml[prow * 2] = m_i
                    part_ml[prow * 2 + 1] = l_i
                if active > self.leave:  # (a counter per (KV head, part): each part combines its own heads)
                    self._combine_last(storage, counters, part_acc, part_ml, head_out, head, splits, active,
                                       kvh * (self.group // self.hpc) + part, tidx, lane)

    @cute.jit
    def _ask_block(self, cache, page_row: cute.Tensor, k_s, v_s, bar, start, nk, page_size, kvh, head_stride,
                   kind_stride):
        """Bulk copies of keys start .. start + nk - 1's K and V rows (a copy per run within a page; start a
        multiple of BLOCK_N, page_size a power of 2) into k_s / v_s, completing on `bar`."""
        cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * nk * D * 2)
        piece = cutlass.min(page_size, BLOCK_N)
        for i in cutlass.range((nk + piece - 1) // piece, unroll=1):
            pos = start + i * piece
            n = cutlass.min(piece, nk - i * piece)
            page = cutlass.Int64(page_row[pos // page_size])
            src = cache + (page * 2 * kind_stride + kvh * head_stride + pos % page_size * D) * 2
            bulk_g2s(k_s + i * piece * D * 2, src, n * D * 2, bar.toint())
            bulk_g2s(v_s + i * piece * D * 2, src + kind_stride * 2, n * D * 2, bar.toint())

    @cute.jit
    def _norm_rope(self, x, wv, c, s, lane, eps):
        """RMSNorm (weight wv) then RoPE of lane `lane`'s four dims of a head row, rounded to bf16 where
        fused_triton's _norm_rope_rows rounds; the partner dims (d +- D/2) are lane ^ 16's."""
        rstd = cute.math.rsqrt(warp_sum(x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]) / D + eps)
        y = [bf16_round(bf16_round(x[e] * rstd) * wv[e]) for e in range(4)]
        sign = cutlass.select_(lane < 16, cutlass.Float32(-1.0), cutlass.Float32(1.0))
        yp = [cute.arch.shuffle_sync_bfly(y[e], offset=16) for e in range(4)]
        return [bf16_round(bf16_round(y[e] * c[e]) + bf16_round(sign * yp[e] * s[e])) for e in range(4)]

    @cute.jit
    def _scores(self, q_w_s, k_s, lane):
        """q . K[lane] and q . K[lane + 32] of the block: 16-byte pieces j = (step + lane) % 16 of the key
        rows (consecutive lanes on different banks) against q's dims 8j .. 8j + 7."""
        a0 = cutlass.Float32(0.0)
        a1 = cutlass.Float32(0.0)
        for step in cutlass.range_constexpr(D // 8):
            j = (step + lane) % (D // 8)
            qa = ld_shared_v4f(q_w_s + j * 16)
            qb = ld_shared_v4f(q_w_s + D * 2 + j * 16)
            k0 = ld_shared_bf16x8(k_s + lane * D * 2 + j * 16)
            k1 = ld_shared_bf16x8(k_s + (lane + 32) * D * 2 + j * 16)
            for e in cutlass.range_constexpr(4):
                a0 += qa[e] * k0[e] + qb[e] * k0[4 + e]
                a1 += qa[e] * k1[e] + qb[e] * k1[4 + e]
        return a0, a1

    @cute.jit
    def _values(self, acc, p_w_s, v_s, n0, keys: cutlass.Constexpr, lane):
        """acc (lane's 4 dims) plus p[n] * V[n] over keys n0 .. n0 + keys - 1, every load issued before the
        first FMA (a key a step waited on its loads each step)."""
        ps = [ld_shared_f32(p_w_s + (n0 + i) * 4) for i in range(keys)]
        vs = [ld_shared_bf16x4(v_s + (n0 + i) * D * 2 + lane * 8) for i in range(keys)]
        for i in cutlass.range_constexpr(keys):
            acc = [acc[e] + ps[i] * vs[i][e] for e in range(4)]
        return acc

    @cute.jit
    def _combine_last(self, storage, counters: cute.Tensor, part_acc: cute.Tensor, part_ml: cute.Tensor, head_out,
                      head, splits, active, counter, tidx, lane):
        """The last of the `active` splits to arrive at counter `counter` folds their partials into out for
        the CTA's heads (as fused_triton's _combine_last), COMBINE_ROUND splits' loads together, then zeroes
        the counter."""
        cnt = counters.iterator.toint() + cutlass.Int64(counter) * 4
        last = storage.last.get_tensor(cute.make_layout(1))
        cute.arch.sync_threads()  # every warp's partial stores precede the arrival
        if tidx == 0:
            last[0] = atomic_add_acq_rel(cnt, 1)
        cute.arch.sync_threads()
        if last[0] == active - 1:
            o = [cutlass.Float32(0.0) for _ in range(4)]
            den = cutlass.Float32(0.0)
            mx = -cutlass.Float32.inf
            ml_base = part_ml.iterator.toint()
            acc_base = part_acc.iterator.toint()
            for j0 in cutlass.range(0, active, COMBINE_ROUND, unroll=1):
                ms, ls, outs = [], [], []
                for jj in cutlass.range_constexpr(COMBINE_ROUND):
                    row = head * splits + cutlass.min(j0 + jj, active - 1)  # (past active: weight 0 below)
                    ms.append(ld_global_f32(ml_base + cutlass.Int64(row) * 8))
                    ls.append(ld_global_f32(ml_base + cutlass.Int64(row) * 8 + 4))
                    outs.append(ld_global_bf16x4(acc_base + cutlass.Int64(row * D + lane * 4) * 2))
                for jj in cutlass.range_constexpr(COMBINE_ROUND):
                    m_j = cutlass.select_(j0 + jj < active, ms[jj], -cutlass.Float32.inf)
                    new = cutlass.max(mx, m_j)
                    keep = cute.math.exp(mx - new, fastmath=True)
                    wj = cute.math.exp(m_j - new, fastmath=True) * ls[jj]
                    o = [o[e] * keep + outs[jj][e] * wj for e in range(4)]
                    den = den * keep + wj
                    mx = new
            st_global_bf16x4(head_out, [o[e] / den for e in range(4)])
            if tidx == 0:
                st_global_relaxed_i32(cnt, 0)  # ready for the next launch (graph replays included)


# (q, k, v, q_w, k_w, cos, sin: 8-byte loads; slot; seq_lens; page_row; kv_cache: bulk copies, 8-byte stores;
# out, part_acc: 8-byte stores; part_ml; counters), then splits, page_size, Hkv, scale, eps, pdl
_TENSORS = [(cutlass.BFloat16, 8)] * 7 + [(cutlass.Int64, 8), (cutlass.Int32, 4), (cutlass.Int32, 4),
                                          (cutlass.BFloat16, 16), (cutlass.BFloat16, 8), (cutlass.BFloat16, 8),
                                          (cutlass.Float32, 8), (cutlass.Int32, 4)]


def compile_for_export(arch: str = "sm_90a") -> dict:
    """{export name: compiled fn} for every entry of VARIANTS (arguments: module docstring)."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch={arch!r}: the one-token attention is built for sm_90a")
    opts = f"--gpu-arch {arch} --enable-tvm-ffi"
    *tensors_ints, stream = fake_args(_TENSORS, 3)  # the tensors, splits, page_size, Hkv, the stream
    args = (*tensors_ints, cutlass.Float32(0.0), cutlass.Float32(0.0), cutlass.Int32(0), stream)
    return {name: cute.compile(AttnOneToken(**kw), *args, options=opts) for name, kw in VARIANTS.items()}
