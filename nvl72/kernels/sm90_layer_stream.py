"""A persistent decode step's weight stream with the layer's math left out: what a one-kernel batch-1
step could reach before anyone writes its math (issue #4; tests/runner/gpu_layer_stream_bench.py).

Why: the per-kernel chain stops at ~60% of the bound at batch 1 on the Qwen3-30B-A3B shape (30 us a
layer for 17.7 us of bytes, perf/RESULTS.md): the latency-bound ops (attention, norm + router,
top-k, each kernel's ramp) leave HBM idle, and shared memory does not outlive a kernel, so no weight
can be in an SM before its kernel starts. In one persistent kernel the weights whose addresses do not
depend on the token (q/k/v, o_proj, router: "dense") can stream at any time, ahead of the math, and
only the experts' wait for the routing. This kernel streams exactly the bytes a step of that design
reads, through the shared-memory rings it would use, with grid barriers where the math needs them and
spins standing in for the latency-bound ops, so the design's ceiling is measured first.

Measured (H200, 2026-11-29, RESULTS): 26.2-27.2 us a layer at the engine's latencies (66-68% of the
bytes at copy bandwidth; the kernel chain is at ~30 us with its math), 22.5-25.3 us with no latency at
all. A grid barrier costs 0.5-0.75 us on an idle GPU but ~3 us while the SMs' bulk copies fill HBM's
queue, and the rings (all of shared memory) hold too little to keep HBM busy through the latency.

`LayerStream(pages_a, pages_b, relaxed, gated)`: one CTA an SM (`ctas` of them, all resident: the
caller's check), 8 consumer warps and two producer warps. Ring A (`pages_a` pages of PAGE bytes)
carries the dense weights in consumption order, layer after layer, limited only by free pages (`gated`:
a layer's q/k/v only once the previous layer's routing is known, its o_proj once its q/k/v is done, its
router once its attention is, so no dense copy is in flight at the barriers that end those phases;
`l2`: a third producer warp asks for the next layer's q/k/v pages into L2 (evict_last) once this
layer's q/k/v is done, and the expert pages are copied evict_first; `inflight` D > 0: a producer asks
for a ring's page n only once its page n - D has landed, so no SM has more than D pages a ring in
flight).
Ring B (`pages_b` pages) carries the gate/up and down pages of the layer's `k` routed experts (`ids`);
its producer polls the grid counter for the layer's routing barrier before its first page. A page of
phase P goes to CTA (page mod ctas). Per layer the consumers: q/k/v pages, barrier; spin `attn_ns`
(the attention), barrier; o_proj pages, barrier; router pages, spin `route_ns` (norm, router, top-k),
barrier (the routing is known); gate/up pages, barrier; down pages, barrier. A consumer reads each page
whole from shared memory (16 bytes a thread a step, summed into `out` so no read is dropped), then
frees it (an arrival a warp).

Grid barriers: an add on `ctr[0]` by one thread of each CTA (acq_rel; `relaxed`: a relaxed `red`),
then a poll (acquire; `relaxed`: relaxed) until the count reaches (barrier index + 1) x ctas (`ctr`
zeroed before each launch). Every wait is bounded by `timeout_ms` from the kernel's start: past it the
waiter goes on and counts itself in `ctr[1]`, so a broken run ends with an error count instead of
hanging. Stamps (%globaltimer): CTA 0's release from each barrier at `stamps[layer * BARRIERS + b]`,
CTA c's arrival at `stamps[(c + 1) * layers * BARRIERS + layer * BARRIERS + b]`; CTA 0's first TRACE
pages of each ring in `trace`.

Arguments (flat views): (dense [layers * (qkv + o + r) * PAGE] uint8, experts [layers * experts * (gu
+ dn) * PAGE] uint8, ids [layers * k] int32, ctr [2] int32, out [ctas * 256] fp32, stamps [(ctas + 1) *
layers * BARRIERS] int64, trace [2 * TRACE * 4] int64), then layers, qkv, o, r (dense pages a layer),
gu, dn (pages an expert), attn_ns, route_ns, experts, k, ctas, timeout_ms. Of dense and experts only the
start address is used (a step's experts pass a 32-bit length: a caller passes a view of their first
bytes).
"""
import cutlass
import cutlass.cute as cute

from aot.build import fake_args
from aot.ptx import (atomic_add_acq_rel, bulk_g2s, bulk_g2s_hint, bulk_prefetch_l2, globaltimer, l2_policy,
                     ld_acquire_gpu_i32, ld_relaxed_gpu_i32, ld_shared_v4f, red_add_relaxed_gpu)

ARCHS = ("sm_90a",)
PAGE = 16384
SMEM_BYTES = 227 * 1024 - 1024  # an sm_90 CTA's shared memory, less the rings' mbarriers
CONSUMER_WARPS = 8
TRACE = 1024  # CTA 0's first pages of ring A, then of ring B, traced: (consumer wait start, page there, page freed,
# producer issue) %globaltimer stamps
BARRIERS = 6  # a layer's grid barriers: after q/k/v, attention, o_proj, routing, gate/up, down
ROUTED = 3  # the barrier after which a layer's expert pages may be asked for
# LayerStream's (pages_a, pages_b[, relaxed, gated, l2, inflight]), 16 KB pages: 192 KB of shared memory
VARIANTS = {"stream_a8_b4": (8, 4), "stream_a4_b8": (4, 8), "stream_a8_b4_relaxed": (8, 4, True),
            "stream_a8_b4_gated": (8, 4, True, True), "stream_a8_b4_l2": (8, 4, True, True, True),
            "stream_a8_b4_d2": (8, 4, True, True, False, 2), "stream_a8_b4_d3": (8, 4, True, True, False, 3)}


class LayerStream:
    """One compiled ring split (see the module docstring)."""

    def __init__(self, pages_a: int, pages_b: int, relaxed: bool = False, gated: bool = False, l2: bool = False,
                 inflight: int = 0):
        if pages_a < 1 or pages_b < 1 or (pages_a + pages_b) * PAGE > SMEM_BYTES:
            raise ValueError(f"pages_a={pages_a}, pages_b={pages_b}: each ring needs a page and both fit in "
                             f"{SMEM_BYTES // 1024} KB of {PAGE // 1024} KB pages")
        if not 0 <= inflight < min(pages_a, pages_b):  # (page n - inflight's slot must not be reused yet)
            raise ValueError(f"inflight={inflight}: 0 (no limit) or fewer than either ring's pages "
                             f"({pages_a}, {pages_b})")
        self.na, self.nb, self.relaxed, self.gated, self.l2 = pages_a, pages_b, relaxed, gated, l2
        self.inflight = inflight
        self.threads = 32 * (CONSUMER_WARPS + (3 if l2 else 2))
        self.cthreads = 32 * CONSUMER_WARPS

    @cute.jit
    def __call__(self, dense: cute.Tensor, experts_w: cute.Tensor, ids: cute.Tensor, ctr: cute.Tensor,
                 out: cute.Tensor, stamps: cute.Tensor, trace: cute.Tensor, layers: cutlass.Int32,
                 qkv: cutlass.Int32, o: cutlass.Int32, r: cutlass.Int32, gu: cutlass.Int32, dn: cutlass.Int32, attn_ns: cutlass.Int32,
                 route_ns: cutlass.Int32, experts: cutlass.Int32, k: cutlass.Int32, ctas: cutlass.Int32,
                 timeout_ms: cutlass.Int32, stream):
        n = self.na + self.nb

        @cute.struct
        class Storage:
            full: cute.struct.MemRange[cutlass.Int64, n]
            empty: cute.struct.MemRange[cutlass.Int64, n]
            ring: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, n * PAGE], 128]

        self.storage = Storage
        self.kernel(dense, experts_w, ids, ctr, out, stamps, trace, layers, qkv, o, r, gu, dn, attn_ns, route_ns, experts,
                    k, ctas, timeout_ms).launch(grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def mine(self, pages, c, ctas):
        """How many of a phase's `pages` CTA `c` takes (pages c, c + ctas, ...)."""
        cnt = cutlass.Int32(0)
        if c < pages:
            cnt = (pages - c + ctas - 1) // ctas
        return cnt

    @cute.jit
    def wait_count(self, ctr_addr, target, t0, limit, err_addr):
        """Poll the grid counter until it reaches `target` or the time limit (then flag and go on)."""
        poll = ld_relaxed_gpu_i32 if cutlass.const_expr(self.relaxed) else ld_acquire_gpu_i32
        v = poll(ctr_addr)
        late = cutlass.Int32(0)
        while (v < target) & (late == 0):
            if globaltimer() - t0 > limit:
                late = cutlass.Int32(1)
                atomic_add_acq_rel(err_addr, 1)
            v = poll(ctr_addr)

    @cute.jit
    def throttle(self, full, slots: cutlass.Constexpr, first: cutlass.Constexpr, n):
        """(`inflight`) Before a ring's page n: wait until page n - inflight has landed."""
        if cutlass.const_expr(self.inflight > 0):
            if n >= self.inflight:
                m = n - self.inflight
                cute.arch.mbarrier_wait(full + first + m % slots, (m // slots) % 2)

    @cute.jit
    def issue(self, ring, full, empty, slots: cutlass.Constexpr, first: cutlass.Constexpr, n, src, c, trace):
        """Ask for the PAGE bytes at `src` into the ring's next slot, once it is free (and, with
        `inflight`, once page n - inflight has landed); `n` counts the ring's pages so far. Returns n + 1."""
        s = n % slots
        cute.arch.mbarrier_wait(empty + first + s, ((n // slots) % 2) ^ 1)
        self.throttle(full, slots, first, n)
        row = (n + (0 if first == 0 else TRACE)) * 4 + 3  # (a ternary inside the traced `if` does not compile)
        if c == 0 and n < TRACE:
            trace[row] = globaltimer()
        cute.arch.mbarrier_arrive_and_expect_tx(full + first + s, PAGE)
        if cutlass.const_expr(first != 0 and self.l2):  # expert pages, streamed once: L2 is the dense pages'
            bulk_g2s_hint(ring + (first + s) * PAGE, src, PAGE, (full + first + s).toint(), l2_policy(False))
        else:
            bulk_g2s(ring + (first + s) * PAGE, src, PAGE, (full + first + s).toint())
        return n + 1

    @cute.jit
    def produce(self, ring, full, empty, n, src, c, ctas, cnt, trace):
        """Ask for this CTA's `cnt` pages of a dense phase starting at `src` (pages c, c + ctas, ...) into
        ring A. Returns the ring's new page count."""
        for j in cutlass.range(cnt):
            n = self.issue(ring, full, empty, self.na, 0, n, src + cutlass.Int64(c + j * ctas) * PAGE, c, trace)
        return n

    @cute.jit
    def consume(self, ring, full, empty, slots: cutlass.Constexpr, first: cutlass.Constexpr, n, cnt, tidx, acc,
                trace, c):
        """Read `cnt` pages whole as they arrive, freeing each (an arrival a consumer warp)."""
        per = PAGE // (16 * self.cthreads)
        for j in cutlass.range(cnt):
            s = n % slots
            traced = (c == 0) & (tidx == 0) & (n < TRACE)
            row = (n + (0 if first == 0 else TRACE)) * 4
            if traced:
                trace[row] = globaltimer()
            cute.arch.mbarrier_wait(full + first + s, (n // slots) % 2)
            if traced:
                trace[row + 1] = globaltimer()
            base = ring + (first + s) * PAGE
            for i in cutlass.range_constexpr(per):
                v = ld_shared_v4f(base + (i * self.cthreads + tidx) * 16)
                acc += v[0] + v[1] + v[2] + v[3]
            cute.arch.sync_warp()
            if tidx % 32 == 0:
                cute.arch.mbarrier_arrive(empty + first + s)
            if traced:
                trace[row + 2] = globaltimer()
            n += 1
        return n, acc

    @cute.jit
    def grid_barrier(self, idx, tidx, c, ctas, ctr_addr, err_addr, stamps, t0, limit, nstamps):
        """The consumers of every CTA meet (see the module docstring); each CTA stamps its arrival, CTA 0 the
        release."""
        cute.arch.barrier(barrier_id=1, number_of_threads=self.cthreads)
        if tidx == 0:
            stamps[(c + 1) * nstamps + idx] = globaltimer()
            if cutlass.const_expr(self.relaxed):
                red_add_relaxed_gpu(ctr_addr, 1)
            else:
                atomic_add_acq_rel(ctr_addr, 1)
            self.wait_count(ctr_addr, (idx + 1) * ctas, t0, limit, err_addr)
            if c == 0:
                stamps[idx] = globaltimer()
        cute.arch.barrier(barrier_id=1, number_of_threads=self.cthreads)

    @cute.jit
    def spin(self, ns, tidx):
        if tidx == 0:
            t = globaltimer()
            while globaltimer() - t < cutlass.Int64(ns):
                pass

    @cute.kernel
    def kernel(self, dense: cute.Tensor, experts_w: cute.Tensor, ids: cute.Tensor, ctr: cute.Tensor,
               out: cute.Tensor, stamps: cute.Tensor, trace: cute.Tensor, layers: cutlass.Int32,
               qkv: cutlass.Int32, o: cutlass.Int32, r: cutlass.Int32, gu: cutlass.Int32, dn: cutlass.Int32,
               attn_ns: cutlass.Int32, route_ns: cutlass.Int32, experts: cutlass.Int32, k: cutlass.Int32, ctas: cutlass.Int32,
               timeout_ms: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        c, _, _ = cute.arch.block_idx()
        t0 = globaltimer()
        limit = cutlass.Int64(timeout_ms) * 1000000
        st = cutlass.utils.SmemAllocator().allocate(self.storage)
        full, empty = st.full.data_ptr(), st.empty.data_ptr()
        ring = st.ring.data_ptr().toint()
        na, nb = self.na, self.nb
        if tidx == 0:
            for s in cutlass.range_constexpr(na + nb):
                cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init(empty + s, CONSUMER_WARPS)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        warp = tidx // 32
        ctr_addr = ctr.iterator.toint()
        err_addr = ctr_addr + 4
        dense_layer = cutlass.Int64(qkv + o + r) * PAGE
        expert_bytes = cutlass.Int64(gu + dn) * PAGE
        if warp == CONSUMER_WARPS:
            if tidx % 32 == 0:  # ring A: the dense pages, as far ahead as the ring allows
                n = cutlass.Int32(0)
                for layer in cutlass.range(layers):
                    base = dense.iterator.toint() + cutlass.Int64(layer) * dense_layer
                    b0 = layer * BARRIERS
                    if cutlass.const_expr(self.gated):  # q/k/v once the last layer's routing is known
                        self.wait_count(ctr_addr, (b0 - BARRIERS + ROUTED + 1) * ctas, t0, limit, err_addr)
                    n = self.produce(ring, full, empty, n, base, c, ctas, self.mine(qkv, c, ctas), trace)
                    if cutlass.const_expr(self.gated):  # o_proj once q/k/v is done
                        self.wait_count(ctr_addr, (b0 + 1) * ctas, t0, limit, err_addr)
                    n = self.produce(ring, full, empty, n, base + cutlass.Int64(qkv) * PAGE, c, ctas,
                                     self.mine(o, c, ctas), trace)
                    if cutlass.const_expr(self.gated):  # the router once the attention is done
                        self.wait_count(ctr_addr, (b0 + 2) * ctas, t0, limit, err_addr)
                    n = self.produce(ring, full, empty, n, base + cutlass.Int64(qkv + o) * PAGE, c, ctas,
                                     self.mine(r, c, ctas), trace)
        elif warp == CONSUMER_WARPS + 1:
            if tidx % 32 == 0:  # ring B: a layer's expert pages once its routing is known
                n = cutlass.Int32(0)
                for layer in cutlass.range(layers):
                    self.wait_count(ctr_addr, (layer * BARRIERS + ROUTED + 1) * ctas, t0, limit, err_addr)
                    for part in cutlass.range_constexpr(2):  # gate/up pages, then down pages
                        per = gu if part == 0 else dn
                        skip = cutlass.Int64(0) if part == 0 else cutlass.Int64(gu) * PAGE
                        for j in cutlass.range(self.mine(k * per, c, ctas)):
                            p = c + j * ctas
                            e = cutlass.Int64(ids[layer * k + p // per])
                            src = (experts_w.iterator.toint() + (cutlass.Int64(layer) * experts + e) * expert_bytes
                                   + skip + cutlass.Int64(p % per) * PAGE)
                            n = self.issue(ring, full, empty, nb, na, n, src, c, trace)
        elif warp == CONSUMER_WARPS + 2:
            if tidx % 32 == 0:  # (l2) the next layer's q/k/v into L2 while this layer's attention runs
                for layer in cutlass.range(layers - 1):
                    self.wait_count(ctr_addr, (layer * BARRIERS + 1) * ctas, t0, limit, err_addr)
                    base = dense.iterator.toint() + cutlass.Int64(layer + 1) * dense_layer
                    for j in cutlass.range(self.mine(qkv, c, ctas)):
                        bulk_prefetch_l2(base + cutlass.Int64(c + j * ctas) * PAGE, PAGE, l2_policy(True))
        else:
            acc = cutlass.Float32(0.0)
            ma = cutlass.Int32(0)
            mb = cutlass.Int32(0)
            for layer in cutlass.range(layers):
                b0 = layer * BARRIERS
                ma, acc = self.consume(ring, full, empty, na, 0, ma, self.mine(qkv, c, ctas), tidx, acc, trace, c)
                self.grid_barrier(b0, tidx, c, ctas, ctr_addr, err_addr, stamps, t0, limit, layers * BARRIERS)
                self.spin(attn_ns, tidx)
                self.grid_barrier(b0 + 1, tidx, c, ctas, ctr_addr, err_addr, stamps, t0, limit, layers * BARRIERS)
                ma, acc = self.consume(ring, full, empty, na, 0, ma, self.mine(o, c, ctas), tidx, acc, trace, c)
                self.grid_barrier(b0 + 2, tidx, c, ctas, ctr_addr, err_addr, stamps, t0, limit, layers * BARRIERS)
                ma, acc = self.consume(ring, full, empty, na, 0, ma, self.mine(r, c, ctas), tidx, acc, trace, c)
                self.spin(route_ns, tidx)
                self.grid_barrier(b0 + ROUTED, tidx, c, ctas, ctr_addr, err_addr, stamps, t0, limit, layers * BARRIERS)
                mb, acc = self.consume(ring, full, empty, nb, na, mb, self.mine(k * gu, c, ctas), tidx, acc, trace, c)
                self.grid_barrier(b0 + 4, tidx, c, ctas, ctr_addr, err_addr, stamps, t0, limit, layers * BARRIERS)
                mb, acc = self.consume(ring, full, empty, nb, na, mb, self.mine(k * dn, c, ctas), tidx, acc, trace, c)
                self.grid_barrier(b0 + 5, tidx, c, ctas, ctr_addr, err_addr, stamps, t0, limit, layers * BARRIERS)
            out[c * self.cthreads + tidx] = acc


# (dense, experts, ids, ctr, out, stamps), then the 12 scalars of the module docstring
_ARGS = ([(cutlass.Uint8, 16), (cutlass.Uint8, 16), (cutlass.Int32, 4), (cutlass.Int32, 4), (cutlass.Float32, 4),
          (cutlass.Int64, 8), (cutlass.Int64, 8)], 12)


def compile_for_export(arch: str = "sm_90a") -> dict:
    """{export name: compiled fn} for every ring split of VARIANTS (arguments: module docstring)."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch={arch!r}: the layer-stream skeleton is built for sm_90a")
    opts = f"--gpu-arch {arch} --enable-tvm-ffi"
    return {name: cute.compile(LayerStream(*split), *fake_args(*_ARGS), options=opts)
            for name, split in VARIANTS.items()}
