"""Every memory access of the fused dispatch/combine kernels lies inside its buffer (CPU emulation).

The kernels (comms/kernels/dispatch.py) address peers' heaps and local tensors through raw byte
offsets, so an index error is an illegal address on the GPU and nothing on a CPU. This emulates
their address arithmetic per phase, vectorised over work units, with the host's real region
layout (`comms.dispatch_fused.heap_regions`) and buffer sizes (`DispatchCombine.packed_rows`),
and asserts each access's [first byte, last byte] lies inside the region or tensor it addresses.
It also checks the 32-bit products the kernels form (work-unit counts, table indices) and the
shared-memory table bounds. Configs: the GPU test's, the perf sweep's (up to 4096 tokens,
hidden 7168, 256 experts, top-8) and EP sizes up to 72; both payloads (bf16, mxfp8)."""
from __future__ import annotations

import pytest
import torch

from comms import dispatch_fused as host

CHUNK = host.CHUNK_BYTES          # bytes per (row, chunk) work unit: 32 lanes x 4 vectors x 16 B
INT32_MAX = 2**31 - 1


class Region:
    """A byte range [lo, hi) of one buffer; `check` asserts accesses [start, start + width) fit."""

    def __init__(self, name: str, lo: int, nbytes: int):
        self.name, self.lo, self.hi = name, lo, lo + nbytes

    def check(self, start: torch.Tensor, width: int, what: str) -> None:
        start = torch.as_tensor(start, dtype=torch.int64).flatten()
        if not start.numel():
            return
        a, b = int(start.min()), int(start.max()) + width
        assert a >= self.lo and b <= self.hi, (
            f"{what}: bytes [{a}, {b}) outside {self.name} [{self.lo}, {self.hi})")


def _heap(world, E, K, H, M, payload="bf16", phases=1):
    """The host's regions at the offsets its bump allocator gives them (REGION_ALIGN aligned)."""
    out, off = {}, 0
    for name, nbytes in host.heap_regions(world, E, K, H, M, payload, phases):
        off = -(-off // host.REGION_ALIGN) * host.REGION_ALIGN
        out[name] = Region(name, off, nbytes)
        off += nbytes
    assert off <= host.heap_bytes(world, E, K, H, M, payload, phases), "regions overrun heap_bytes (the heap's size)"
    return out


def _mx_sends(row_off: torch.Tensor, H: int):
    """MXFP8 A2 stores of every (token, 1024-value chunk) unit into staged rows at `row_off`:
    (8-byte E4M3 stores at row + c*1024 + q*256 + lane*8, 1-byte scales at row + H + c*32 + q*8 + l/4)."""
    c = torch.arange(H // 1024)
    vals = (c[:, None, None] * 1024 + torch.arange(4)[None, :, None] * 256 + torch.arange(32)[None, None, :] * 8)
    scl = H + (c[:, None, None] * 32 + torch.arange(4)[None, :, None] * 8 + torch.arange(8)[None, None, :])
    return ((row_off.flatten()[:, None] + vals.flatten()[None, :]).flatten(),
            (row_off.flatten()[:, None] + scl.flatten()[None, :]).flatten())


def _staged_vectors(rvec: int) -> torch.Tensor:
    """Vector indices v = c*128 + q*32 + lane of every (row, chunk) unit over a staged row of `rvec`
    16-byte vectors (the last chunk partial)."""
    nchunk = -(-rvec // 128)
    return (torch.arange(nchunk)[:, None, None] * 128 + torch.arange(4)[None, :, None] * 32
            + torch.arange(32)[None, None, :]).flatten()


def _unit_vectors(row_bytes_off: torch.Tensor, nchunk: int) -> torch.Tensor:
    """First byte of every 16-byte vector a (row, chunk) unit touches, given each row's byte offset:
    chunk c, lane l, vector q -> row + c*2048 + l*16 + q*512 (comms.kernels.dispatch)."""
    c = torch.arange(nchunk) * CHUNK
    lanes = torch.arange(32) * 16
    q = torch.arange(4) * 512
    per_unit = (c[:, None, None] + lanes[None, :, None] + q[None, None, :]).flatten()
    return (row_bytes_off.flatten()[:, None] + per_unit[None, :]).flatten()


def _routing(world, E, K, toks, gen):
    return [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]) if t else
            torch.empty(0, K, dtype=torch.long) for t in toks]


def emulate(world, E, K, H, M, toks, layout, ids=None, cap=None, gen=None, payload="bf16"):
    """Run every phase's address arithmetic for all ranks; returns the number of accesses checked."""
    L = E // world
    assert world <= host.MAX_WORLD and L <= host.MAX_LOCAL and world * L <= host.MAX_PAIRS, \
        f"world={world} L={L} exceed the kernels' shared-memory tables"
    assert H % (CHUNK // 2) == 0 and K in host.TOPK_VARIANTS
    nvec, row_bytes = H // 8, H * 2
    nchunk = nvec // (CHUNK // 16)
    rows_in = M * world
    cap = rows_in if cap is None else cap
    nrows = L * cap if layout == "masked" else min(L * cap, rows_in * min(K, L))
    heap = _heap(world, E, K, H, M, payload)
    fp8 = payload == "mxfp8"
    rx_row = host.staged_row_bytes(H, payload)  # bytes per staged row in rx
    assert rx_row % 16 == 0, f"staged rows of {rx_row} bytes are not 16-byte aligned"
    rvec, hvec = rx_row // 16, (H // 16 if fp8 else H // 8)
    vecs = _staged_vectors(rvec)
    ids = ids if ids is not None else _routing(world, E, K, toks, gen)
    n = 0
    # 32-bit work-unit counts and table products (Int32 in the kernels)
    for v, what in ((max(toks) * nchunk, "ntok * nchunk"), (rows_in * nchunk, "received rows * nchunk"),
                    (world * L, "nlocal * world"), (rows_in * K, "row_pos entries"),
                    (nrows * nvec, "packed row vectors (o_* indices)")):
        assert v <= INT32_MAX, f"{what} = {v} overflows int32"
    # ---- dispatch A1 (sender s -> owner d of expert g): rslot[(s*M + t)*K + hit], recnt[s*L + e]
    recnt = torch.zeros(world, world, L, dtype=torch.long)  # [dest, source, local expert]
    rslot = [torch.full((world * M, K), -1, dtype=torch.long) for _ in range(world)]
    for s, ids_s in enumerate(ids):
        T = ids_s.shape[0]
        assert T <= M
        t_idx = torch.arange(T)[:, None].expand(T, K)
        dest = ids_s // L
        # index of each hit among source s's tokens of the same expert (ballot + popc order)
        order = torch.zeros_like(ids_s)
        for g in ids_s.unique().tolist():
            hit = ids_s == g
            order[hit] = torch.cumsum(hit.any(1).long(), 0)[hit.any(1)] - 1
        for d in range(world):
            sel = dest == d
            row = s * M + t_idx[sel]
            heap["rslot"].check(((row * K + torch.nonzero(sel)[:, 1]) * 4) + heap["rslot"].lo, 4, "A1 rslot")
            rslot[d][row, torch.nonzero(sel)[:, 1]] = order[sel]
            e = ids_s[sel] - d * L
            recnt[d, s] = torch.bincount(e, minlength=L)
            for parity in (0, 1):  # the tables alternate by epoch parity
                heap["recnt"].check(((parity * world + s) * L + torch.arange(L)) * 4 + heap["recnt"].lo, 4,
                                    "A1 recnt")
            n += int(sel.sum()) + L
    # ---- dispatch A2: x rows read, rx written once per destination rank (bf16: read back and emptied by
    # the pack at the same addresses)
    rntok = torch.tensor(toks)
    for s, ids_s in enumerate(ids):
        T = ids_s.shape[0]
        Region("x", 0, T * row_bytes).check(_unit_vectors(torch.arange(T) * row_bytes, nchunk), 16, "A2 x read")
        for d in range(world):
            t = torch.nonzero((ids_s // L == d).any(1)).flatten()
            row = s * M + t
            if d == s:
                pass  # own rows are not staged: packed from x (below); only ids, weights, stamp
            elif fp8:
                vals, scl = _mx_sends(heap["rx"].lo + row * rx_row, H)
                heap["rx"].check(vals, 8, "A2 rx E4M3 write")
                heap["rx"].check(scl, 1, "A2 rx scale write")
                assert bool((((vals - heap["rx"].lo) % rx_row) + 8 <= H).all()), "E4M3 bytes spill into scales"
            else:
                heap["rx"].check(_unit_vectors(heap["rx"].lo + row * row_bytes, nchunk), 16, "A2 rx write")
            # the row's metadata, written in A1 by the scan of the token's first expert on d
            for name in ("rid", "rw"):
                heap[name].check(heap[name].lo + ((row[:, None] * K + torch.arange(K)) * 4), 4, f"A1 {name}")
            heap["rstamp"].check(heap["rstamp"].lo + row * 4, 4, "A1 rstamp")
            heap["rntok"].check(heap["rntok"].lo + torch.tensor([s * 4, (world + s) * 4]), 4, "A2 rntok")
            heap["dcnt"].check(heap["dcnt"].lo + torch.tensor([s * 4, (world + s) * 4]), 4, "tables / rows dcnt")
            n += row.numel() * (nchunk * 128 + 2 * K + 1)
    # ---- dispatch C and combine, per receiving rank
    # the table poll (_load_tables): thread tid's recnt words tid + THREADS k and rntok word tid, clamped
    tid, loads = torch.arange(host.THREADS), host.MAX_PAIRS // host.THREADS
    pair = torch.clamp(tid[:, None] + host.THREADS * torch.arange(loads), max=world * L - 1)
    for parity in (0, 1):
        heap["recnt"].check(heap["recnt"].lo + (parity * world * L + pair) * 4, 4, "table poll recnt")
        heap["rntok"].check(heap["rntok"].lo + (parity * world + torch.clamp(tid, max=world - 1)) * 4, 4,
                            "table poll rntok")
    for r in range(world):
        heap["state"].check(heap["state"].lo + torch.arange(4) * 4, 4, "epoch state")
        rstart = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(rntok, 0)])
        assert world + 1 <= host.MAX_WORLD + 1
        total = int(rstart[world])
        rr = torch.arange(total)
        s = torch.searchsorted(rstart[1:world + 1], rr, right=True)  # largest s with rstart[s] <= rr
        assert bool((s < world).all())
        t = rr - rstart[s]
        row = s * M + t
        assert bool((t < M).all()), "received row index past max_tokens"
        heap["rstamp"].check(heap["rstamp"].lo + row * 4, 4, "C rstamp read")
        for name in ("rid", "rw", "rslot"):
            heap[name].check(heap[name].lo + (row[:, None] * K + torch.arange(K)) * 4, 4, f"C {name} read")
        peer = s != r  # own rows are packed from x
        if fp8:  # loads clamp to the row's last vector; each row read within itself
            ld = heap["rx"].lo + row[peer][:, None] * rx_row + vecs.clamp(max=rvec - 1)[None, :] * 16
            heap["rx"].check(ld, 16, "C rx read")
            assert bool((((ld - heap["rx"].lo) % rx_row) + 16 <= rx_row).all()), "C read crosses a staged row"
        else:
            heap["rx"].check(_unit_vectors(heap["rx"].lo + row[peer] * row_bytes, nchunk), 16, "C rx read")
        ids_rows = torch.stack([ids[int(a)][int(b)] for a, b in zip(s, t)]) if total else torch.empty(0, K,
                                                                                                      dtype=torch.long)
        sent = (ids_rows // L == r).any(1)  # stamp == epoch
        lid = ids_rows - r * L
        local = sent[:, None] & (lid >= 0) & (lid < L)
        pre = torch.cumsum(recnt[r], 0) - recnt[r]  # [source, local expert], exclusive over sources
        totals = recnt[r].sum(0)
        base = torch.arange(L) * cap if layout == "masked" else torch.cumsum(totals, 0) - totals
        lid_c = lid.clamp(0, L - 1)
        p = pre[s[:, None].expand_as(lid_c), lid_c] + rslot[r][row]
        posv = torch.where(local & (p < cap), base[lid_c] + p, torch.full_like(p, -1))
        posv = torch.where(posv >= nrows, torch.full_like(posv, -1), posv)
        assert bool((rslot[r][row][local] >= 0).all()), "a local slot without its slot index"
        ok = posv >= 0
        assert int(ok.sum()) == int(local.sum()), "entries dropped although capacity suffices"
        own = ok & (s == r)[:, None]  # own slots: (token, chunk) units of x stored to their packed rows
        Region("x", 0, toks[r] * row_bytes).check(_unit_vectors(t[own.any(1)] * row_bytes, nchunk), 16, "C own x read")
        if fp8:  # the sender's staged-row stores, at packed rows of H value bytes and H / 32 scale bytes
            vals, _ = _mx_sends(posv[own] * H, H)
            _, scl = _mx_sends(posv[own] * (H // 32) - H, H)
            Region("out_x", 0, nrows * H).check(vals, 8, "C own out_x E4M3 write")
            Region("out_s", 0, nrows * (H // 32)).check(scl, 1, "C own out_s write")
            assert bool(((scl - posv[own].repeat_interleave(scl.numel() // max(int(own.sum()), 1)) * (H // 32))
                         < H // 32).all()), "own scale bytes spill into the next packed row"
        if fp8:
            pos = posv[ok][:, None]
            vv, sv = vecs[vecs < hvec], vecs[(vecs >= hvec) & (vecs < rvec)]
            assert vv.numel() + sv.numel() == rvec * 1, "a staged vector is stored twice or never"
            Region("out_x", 0, nrows * H).check(pos * H + vv[None, :] * 16, 16, "C out_x E4M3 write")
            Region("out_s", 0, nrows * (H // 32)).check(pos * (H // 32) + (sv[None, :] - hvec) * 16, 16,
                                                        "C out_s write")
        else:
            Region("out_x", 0, nrows * row_bytes).check(_unit_vectors(posv[ok] * row_bytes, nchunk), 16,
                                                        "C out_x write")
        for name, width in (("o_rank", 4), ("o_tok", 4), ("o_w", 4)):
            Region(name, 0, nrows * width).check(posv[ok] * width, width, f"C {name} write")
        row_pos_idx = row[:, None] * K + torch.arange(K)
        Region("row_pos", 0, rows_in * K * 4).check(row_pos_idx[ok] * 4, 4, "C row_pos write")
        Region("rstart", 0, (world + 1) * 4).check(torch.arange(world + 1) * 4, 4, "C rstart write / combine read")
        Region("counts", 0, L * 4).check(torch.arange(L) * 4, 4, "C counts")
        Region("offsets", 0, (L + 1) * 4).check(torch.arange(L + 1) * 4, 4, "C offsets")
        # packed positions are distinct (no two entries share a row)
        assert posv[ok].unique().numel() == int(ok.sum()), "two entries packed into one row"
        # ---- combine: sends (other sources' rows routed here): y rows read at row_pos, the partial
        # written to the source's cx[r, t]; sums (own tokens): this rank's partial from y at its own
        # rows' row_pos, the peers' partials read (and emptied) at cx[d, t], out[t] written
        keys = max(toks) if toks else 0
        assert keys * world * nchunk <= INT32_MAX, "combine work units overflow int32"
        send = sent & peer
        Region("row_pos", 0, rows_in * K * 4).check(row_pos_idx[send] * 4, 4, "combine send row_pos read")
        Region("y", 0, nrows * row_bytes).check(_unit_vectors(posv[ok & send[:, None]] * row_bytes, nchunk), 16,
                                                "combine send y read")
        heap["cx"].check(_unit_vectors(heap["cx"].lo + (r * M + t[send]) * row_bytes, nchunk), 16,
                         "combine cx write (peer)")
        T = toks[r]
        d = ids[r] // L
        own_rows = r * M + torch.arange(T)
        heap["rw"].check(heap["rw"].lo + (own_rows[:, None] * K + torch.arange(K)) * 4, 4, "combine sum rw read")
        Region("row_pos", 0, rows_in * K * 4).check((own_rows[:, None] * K + torch.arange(K)) * 4, 4,
                                                    "combine sum row_pos read")
        mine = sent & ~peer
        Region("y", 0, nrows * row_bytes).check(_unit_vectors(posv[ok & mine[:, None]] * row_bytes, nchunk), 16,
                                                "combine sum y read")
        peers_of = d[d != r]
        tok_of = torch.arange(T)[:, None].expand_as(d)[d != r]
        heap["cx"].check(_unit_vectors(heap["cx"].lo + (peers_of * M + tok_of) * row_bytes, nchunk), 16,
                         "combine cx read / empty")
        Region("out", 0, T * row_bytes).check(_unit_vectors(torch.arange(T) * row_bytes, nchunk), 16, "combine out")
        Region("ids", 0, T * K * 4).check((torch.arange(T)[:, None] * K + torch.arange(K)) * 4, 4, "ids read")
        n += total * K * 4 + int(ok.sum()) * (nchunk * 128 * 2 + 4) + T * nchunk * 128
    return n


# (experts, top_k, hidden, max_tokens, tokens per rank, layouts): tests/comms/test_dispatch_gpu.py CONFIGS
GPU_TEST = [
    (16, 4, 1024, 64, (37, 64), ("masked", "contiguous")),
    (16, 4, 1024, 64, (0, 1), ("masked",)),
    (128, 8, 4096, 128, (128, 100), ("masked", "contiguous")),
    (256, 8, 7168, 32, (32, 17), ("contiguous",)),
]


@pytest.mark.parametrize("payload", ["bf16", "mxfp8"])
@pytest.mark.parametrize("E,K,H,M,toks,layouts", GPU_TEST)
def test_gpu_test_configs_stay_in_bounds(E, K, H, M, toks, layouts, payload):
    gen = torch.Generator().manual_seed(E + K + M)
    for layout in layouts:
        assert emulate(2, E, K, H, M, toks, layout, gen=gen, payload=payload) > 0


@pytest.mark.parametrize("payload", ["bf16", "mxfp8"])
@pytest.mark.parametrize("E,H", [(128, 4096), (256, 7168)])
@pytest.mark.parametrize("T", [1, 512, 4096])
def test_perf_sweep_stays_in_bounds(E, H, T, payload):
    """perf.comms dispatch: max_tokens = the largest swept count (4096), contiguous, top-8."""
    gen = torch.Generator().manual_seed(T)
    assert emulate(2, E, 8, H, 4096, (T, T), "contiguous", gen=gen, payload=payload) > 0


@pytest.mark.parametrize("world,E", [(4, 256), (8, 256), (16, 256), (36, 288), (72, 288), (72, 576)])
def test_large_ep_stays_in_bounds(world, E):
    """EP sizes up to 72: per-rank tables live in device memory / shared memory sized by MAX_*."""
    gen = torch.Generator().manual_seed(world)
    toks = tuple(int(v) for v in torch.randint(0, 17, (world,), generator=gen))
    for layout in ("masked", "contiguous"):
        assert emulate(world, E, 8, 1024, 16, toks, layout, gen=gen) > 0


def test_largest_heap_offsets_fit_int64_and_tables():
    """72 ranks x 4096 tokens x hidden 7168: offsets exceed 2**32 (kernels form them in Int64) and
    the unit counts still fit the kernels' Int32 loop variables."""
    R, M, H, K, E = 72, 4096, 7168, 8, 288
    nbytes = host.heap_bytes(R, E, K, H, M)
    assert nbytes > 2**32
    heap = _heap(R, E, K, H, M)
    assert heap["state"].hi <= nbytes
    assert R * M * (H // 1024) <= INT32_MAX


def test_bounds_checker_catches_an_overrun():
    """The checker itself must fail on an out-of-range index (here: a token past max_tokens)."""
    gen = torch.Generator().manual_seed(0)
    ids = _routing(2, 16, 4, (5, 5), gen)
    with pytest.raises(AssertionError):
        emulate(2, 16, 4, 1024, 4, (5, 5), "masked", ids=ids)
    with pytest.raises(AssertionError, match="outside"):
        Region("x", 0, 32).check(torch.tensor([0, 17]), 16, "probe")


@pytest.mark.parametrize("world,phases", [(2, 4), (8, 8), (72, 8)])
def test_pipelined_counters_stay_in_bounds(world, phases):
    """Pipelined dispatch: arrivals on counter (p, source) at dcnt + (p * world + source) * 4 for
    the tables counter (p = 0) and every phase counter (p = 1 + q), rnph[source], and the
    receive-phase tables' shared-memory bound."""
    heap = _heap(world, 8 * world, 8, 1024, 16, "mxfp8", phases)
    p, s = torch.meshgrid(torch.arange(1 + phases), torch.arange(world), indexing="ij")
    heap["dcnt"].check(heap["dcnt"].lo + (p * world + s) * 4, 4, "pipelined arrival")
    heap["rnph"].check(heap["rnph"].lo + torch.arange(world) * 4, 4, "rnph")
    assert phases <= host.PIPE_MAX and world <= host.MAX_WORLD
