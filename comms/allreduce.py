"""`comms.AllReduce`: sum a tensor over the ranks of a symmetric heap's group.

    ar = AllReduce(heap, algo="auto")
    y = ar(x)                                                  # x: [...] bf16 | fp32
    y, res = ar.add_rmsnorm(x, residual, weight, eps, zero_centered=False)

Algorithms (kernels in `comms.kernels.allreduce`, loaded from the `aot` bundle):
  lamport   one-shot whose data is its own flag (sentinel-filled slots, 3 rotating buffers):
            no flags, no fences, no grid-wide hand-off, PDL launch; up to 4 MiB   (latency-bound)
  oneshot   push x to every peer, flag per block, each rank reduces all copies
  twoshot   reduce-scatter + all-gather over NVLink                    (bandwidth-bound sizes);
            when x and out both live in the heap (`symmetric_empty`), a staging-free variant:
            owners read every rank's x and write every rank's out directly
  twoshot_push  two-shot for x and out in the heap (`symmetric_empty`; in place allowed, as torch's
            two_shot_all_reduce_), writes only over NVLink: each rank pushes the chunks it does not
            own to their owners, each owner stores its sum straight into every rank's out; no
            gather slot and no copy-out; a block's slice goes in PUSH_PARTS parts, each flagged
            to its owner as soon as it is out, and the grid is one block per SM. Other inputs
            (not in the heap, or not whole 16-byte vectors) run the staged twoshot. `auto` picks it in the two-shot range when x and
            out are both such heap buffers (measured best there, see below)
  twoshot_pipe  two-shot in 32 KiB tiles with per-tile flags: reduce-scatter of tile k+1, reduce
            of tile k (pushed straight to the peers) and the copy-out of tile k-1 overlap; chosen
            by name only (`auto` does not pick it; its times on ordinary tensors are below)
  multimem  two-shot through NVLink SHARP (multimem.ld_reduce/st); needs a heap created with
            enable_multicast=True on a device with multicast
  nccl      torch.distributed.all_reduce on the heap's (NCCL) group
  reference the CPU path: torch.distributed (gloo) all_reduce in fp32; what the tests compare to
`auto` picks once per size class from `select_algo` (the crossovers below); the choice for a
given size is logged the first time it is made, never changed silently.
`blocks` (AllReduce keyword) fixes the grid of the two-shot kernels (twoshot, its in-heap forms,
twoshot_pipe, multimem) instead of `twoshot_blocks` / `pipe_blocks`: see AllReduce.

Measured crossovers (2 x H200 NV18, bf16, multicast off, CUDA-graph replay, us per all-reduce,
2026-11-21; full table and command in perf/RESULTS.md):
  size      lamport  oneshot  twoshot  nccl    torch one_shot / two_shot   -> auto
  1 KiB       3.67     4.90     7.48   10.90      7.12 / 7.01                 lamport
  128 KiB     5.01     6.23     8.84   13.37      8.69 / 8.07                 lamport
  1 MiB       7.87     8.73    11.08   20.13     13.97 / 11.15                lamport
  4 MiB      17.84    22.82    27.46   36.81     31.84 / 20.69                lamport
  8 MiB        -      37.27    40.66   50.50     52.93 / 33.76                oneshot
  32 MiB       -     112.52   109.32  143.72    199.12 / 117.88               twoshot
  128 MiB      -     446.23   398.88  470.92    736.53 / 494.81               twoshot
(lamport is capped at LAMPORT_MAX_BYTES; above max_bytes auto uses nccl; multimem would replace
twoshot where multicast is enabled: not measured, the lent hosts must not create multicast.)
With x and out both in the heap (`symmetric_empty`; in place as torch's two_shot_all_reduce_ on
symmetric memory), 2 x H200, bf16, graph replay, us, 2026-11-22T03:33Z (perf/RESULTS.md, "In-place
write-only two-shot"):
  (twoshot and twoshot_pipe there on ordinary tensors, the others on heap buffers)
  size      twoshot(staged)  twoshot_symm  twoshot_push  twoshot_pipe  torch two_shot   -> auto
  16 MiB        66.00           60.63         59.84         60.94          62.83          oneshot (<= 16 MiB)
  32 MiB       186.36          123.65        114.62        116.36         119.84          twoshot_push
  64 MiB       210.55          221.40        201.24        213.18         222.89          twoshot_push
  128 MiB      401.80          416.12        382.07        399.01         423.95          twoshot_push
twoshot_push in 4 parts per block on one block per SM (2026-11-22T07:55Z, "Push two-shot in parts"):
16 MiB 58.18, 32 MiB 102.64, 64 MiB 196.73, 128 MiB 379.48 us against torch two_shot 59.16 / 110.45 /
214.61 / 422.67 in the same run (0.898x at 128 MiB).

Semantics: sums in fp32 in rank order, rounded once to the input dtype; every rank gets bitwise
the same result. add_rmsnorm: `res = (sum_r x_r + residual)` rounded to the dtype, then
`y = res * rsqrt(mean(res^2) + eps) * w` (zero_centered: `* (1 + w)`), in fp32, rounded.
A peer that does not arrive within `timeout_s` makes the kernel set an error word in pinned host
memory and finish; the next call (or `check()`) raises `AllReduceTimeoutError`.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from comms.heap import DEFAULT_ALIGN, SymmetricHeap
from aot.launch import stream_allows_pdl

log = logging.getLogger(__name__)

ALGOS = ("auto", "lamport", "oneshot", "twoshot", "twoshot_push", "twoshot_pipe", "multimem", "nccl", "reference")
KERNEL_ALGOS = ("lamport", "oneshot", "twoshot", "twoshot_push", "twoshot_pipe", "multimem")
DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
KERNEL_MODULE = "comms.kernels.allreduce"
# compile-time constants of comms.kernels.allreduce (kept here so CPU code need not import it)
THREADS = 512
MAX_BLOCKS = 256
MAX_WORLD = 8
VEC_BYTES = 16
PUSH_PARTS = 4                 # parts per block slice of twoshot_push (a phase-1 flag array each)
PIPE_TILE = 4 * THREADS        # vectors per twoshot_pipe tile (UNROLL x THREADS)
PIPE_STEP = 1 << 16            # twoshot_pipe flag value = (epoch + 1) * PIPE_STEP + tiles done
ONESHOT_MAX_BYTES = 16 << 20   # flagged one-shot above the Lamport cap, up to here
LAMPORT_MAX_BYTES = 4 << 20   # per-slot capacity of the Lamport buffers
LAMPORT_SENTINEL = -1          # int32 word of an empty Lamport slot
LAMPORT_EPOCHS = 4             # Lamport state: [3 dirty counts, -, MAX_BLOCKS per-block epochs]
DEFAULT_MAX_BYTES = 64 << 20


class AllReduceError(RuntimeError):
    """Bad input or configuration for an all-reduce; the message names the bad value."""


class AllReduceTimeoutError(AllReduceError):
    """A kernel's bounded wait on a peer expired (the peer did not arrive in time)."""


def heap_regions(world: int, max_bytes: int) -> list[tuple[str, int]]:
    """(name, bytes) of one AllReduce's heap regions in allocation order: data [2 parity][W][cap] +
    gather [2][cap]; flags [1 + PUSH_PARTS][MAX_WORLD][MAX_BLOCKS] (phase 1, phase 2, then phase 1
    of twoshot_push's parts 1..); state; twoshot_pipe's per-tile flags [2 phase][MAX_WORLD][MAX_BLOCKS]
    (values of their own scale); the Lamport one-shot's 3 rotating buffers [3][W][lam_cap] of
    sentinel words and its own state [dirty vectors of buffer 0..2, -, per-block epoch copies] (its
    rotation must not see other calls)."""
    lam_cap = min(max_bytes, LAMPORT_MAX_BYTES)
    return [("ws", (2 * world + 2) * max_bytes), ("flag", (1 + PUSH_PARTS) * MAX_WORLD * MAX_BLOCKS * 4),
            ("state", 64), ("pipe_flag", 2 * MAX_WORLD * MAX_BLOCKS * 4), ("lam", 3 * world * lam_cap),
            ("lam_state", 4 * (LAMPORT_EPOCHS + MAX_BLOCKS))]


def heap_bytes(world: int, max_bytes: int) -> int:
    """Symmetric-heap bytes one AllReduce of `max_bytes` takes on `world` ranks, wherever the heap's
    earlier allocations ended (regions aligned as SymmetricHeap.alloc aligns them, the first one's
    alignment included): what a heap must hold per AllReduce, for any world size."""
    return DEFAULT_ALIGN + sum(-(-n // DEFAULT_ALIGN) * DEFAULT_ALIGN for _, n in heap_regions(world, max_bytes))


def select_algo(nbytes: int, world: int, *, device: str, multicast: bool, max_bytes: int,
                in_heap: bool = False) -> str:
    """The `auto` choice for one message size (pure: tested on CPU); sizes are padded bytes.
    in_heap: x and out are both heap buffers the in-heap kernels take (`buffers_in_heap`): the
    two-shot range then runs twoshot_push (measured fastest there; multicast still prefers multimem)."""
    if nbytes < 0 or world < 1:
        raise AllReduceError(f"select_algo(nbytes={nbytes}, world={world}): need nbytes >= 0, world >= 1")
    if device == "cpu":
        return "reference"
    if world > MAX_WORLD or nbytes > max_bytes:
        return "nccl"
    if nbytes <= min(max_bytes, LAMPORT_MAX_BYTES):
        return "lamport"
    if nbytes <= ONESHOT_MAX_BYTES:
        return "oneshot"
    if multicast:
        return "multimem"
    return "twoshot_push" if in_heap else "twoshot"


def buffers_in_heap(x_off: int | None, o_off: int | None, nbytes: int) -> bool:
    """True when x and out, at heap offsets x_off / o_off (None: not in the heap), can run the
    in-heap two-shot kernels: both in the heap, 16-byte aligned and whole vectors long."""
    return (x_off is not None and o_off is not None and nbytes % VEC_BYTES == 0
            and x_off % VEC_BYTES == 0 and o_off % VEC_BYTES == 0)


def heap_kernel(algo: str, x_off: int | None, o_off: int | None, nbytes: int) -> str:
    """The kernel that runs `algo` for x and out at heap offsets x_off / o_off (None: not in the
    heap): twoshot -> twoshot_symm and twoshot_push -> its own kernel when both are in the heap,
    16-byte aligned and whole vectors long; otherwise twoshot_push runs the staged twoshot."""
    in_heap = buffers_in_heap(x_off, o_off, nbytes)
    if algo == "twoshot" and in_heap:
        return "twoshot_symm"
    if algo == "twoshot_push":
        return "twoshot_push" if in_heap else "twoshot"
    return algo


def twoshot_blocks(nvec: int, world: int) -> int:
    """Grid of the two-shot kernels for `nvec` 16-byte vectors: a block per THREADS vectors of a
    chunk, at most MAX_BLOCKS."""
    chunk = -(-nvec // world)
    return max(1, min(MAX_BLOCKS, -(-chunk // THREADS)))


def twoshot_slices(nvec: int, world: int, nblocks: int, parts: int = 1) -> list[list[list[tuple[int, int]]]]:
    """The two-shot kernels' split: [block][part] -> the (start, end) vector span of that part of
    the block's slice of every owner's chunk, owner r at index r (block b pushes, reduces and waits
    on these only; twoshot_push flags them part by part, parts=PUSH_PARTS; the others: 1 part)."""
    chunk = -(-nvec // world)
    per = -(-chunk // nblocks)
    out = []
    for b in range(nblocks):
        b0 = b * per
        n = max(0, min(b0 + per, chunk) - b0)
        pp = -(-n // parts)
        spans = [(b0 + j * pp, min(b0 + (j + 1) * pp, b0 + n)) for j in range(parts)]
        out.append([[(min(c * chunk + s0, (c + 1) * chunk, nvec), min(c * chunk + max(s0, s1), nvec))
                     for c in range(world)] for s0, s1 in spans])
    return out


def pipe_blocks(nvec: int, world: int) -> int:
    """Grid of the twoshot_pipe kernel for `nvec` 16-byte vectors: one block per two tiles of a
    chunk (so most blocks pipeline at least two steps), at most MAX_BLOCKS."""
    chunk = -(-nvec // world)
    ntiles = -(-chunk // PIPE_TILE)
    return max(1, min(MAX_BLOCKS, -(-ntiles // 2)))


def pipe_tiles(nvec: int, world: int, nblocks: int) -> int:
    """Tiles per chunk of twoshot_pipe; raises if a block would walk more than PIPE_STEP - 1 of
    them (its per-tile flag count would reach the next call's values)."""
    chunk = -(-nvec // world)
    ntiles = -(-chunk // PIPE_TILE)
    if -(-ntiles // nblocks) >= PIPE_STEP:
        raise AllReduceError(f"twoshot_pipe: {ntiles} tiles over {nblocks} blocks exceed {PIPE_STEP - 1} steps")
    return ntiles


def pipe_schedule(nvec: int, world: int, nblocks: int) -> list[list[list[tuple[int, int]]]]:
    """The twoshot_pipe kernel's tile walk: [block][step] -> the (start, end) vector span of that
    tile in every owner's chunk, owner r at index r. Block b's step k is tile b + k * nblocks."""
    chunk = -(-nvec // world)
    ntiles = pipe_tiles(nvec, world, nblocks)
    walk = []
    for b in range(nblocks):
        steps = []
        for t in range(b, ntiles, nblocks):
            steps.append([(min(c * chunk + t * PIPE_TILE, nvec),
                           min(c * chunk + t * PIPE_TILE + PIPE_TILE, (c + 1) * chunk, nvec)) for c in range(world)])
        walk.append(steps)
    return walk


def twoshot_grid(kernel: str, nvec: int, world: int, blocks: int | None, sms: int | None = None) -> int:
    """Blocks of a two-shot family launch (`kernel` as `heap_kernel` names it) for nvec vectors:
    `blocks` (AllReduce's override, already clamped) or the kernel's default grid; twoshot_push's
    default is at most one block per SM (`sms`, the device's count): its blocks overlap their
    phases part by part, and a second wave would only add a drain (measured best, 128 MiB)."""
    if blocks is not None:
        return blocks
    if kernel == "twoshot_pipe":
        return pipe_blocks(nvec, world)
    nb = twoshot_blocks(nvec, world)
    return min(nb, sms) if kernel == "twoshot_push" and sms else nb


def check_blocks(blocks) -> int | None:
    """AllReduce's `blocks`: None, or an int clamped to 1..MAX_BLOCKS (the flag arrays hold
    MAX_BLOCKS blocks); raises for < 1 or a non-integer."""
    if blocks is None:
        return None
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise AllReduceError(f"blocks={blocks!r}: expected None or an int >= 1 (clamped to {MAX_BLOCKS})")
    return min(blocks, MAX_BLOCKS)


def reference_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """fp32 sum over the group (torch.distributed), rounded to x's dtype."""
    y = x.float().clone()
    dist.all_reduce(y, group=group)
    return y.to(x.dtype)


def rmsnorm_reference(res: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm of `res` over its last dim in fp32: standard `* w` or zero-centred `* (1 + w)`."""
    r = res.float()
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * w).to(res.dtype)


class AllReduce:
    """All-reduce over `heap.group` through `heap` (see the module docstring).

    Args:
        heap: the symmetric heap (CPU heap -> the reference path).
        algo: one of ALGOS; "auto" picks per size.
        max_bytes: largest message the kernels handle (workspace = (2W + 2) * max_bytes on the heap).
        timeout_s: bound on each wait for a peer inside a kernel.
        pdl: launch the Lamport kernels with programmatic dependent launch on non-default streams
            (CUDA-graph capture included): their blocks become resident while the previous kernel
            on the stream finishes and wait for it on the device. False: ordinary launches.
        blocks: grid of the two-shot family (twoshot, twoshot_symm, twoshot_push, twoshot_pipe,
            multimem, also when `auto` picks them); None: `twoshot_grid` (256 from 16 MiB up on
            2 ranks, twoshot_push at most one per SM). An int is clamped to 1..MAX_BLOCKS; any
            count splits correctly (`twoshot_slices`). Residency: block b of a launch waits on
            block b of every peer, so blocks beyond those co-resident (512 threads each; ptxas
            13.0 -v of the sm_90a PTX, not of the bundle's own cubin: twoshot / twoshot_symm /
            twoshot_push 102-106 registers per thread in bf16, 82-90 in fp32 -> 1 block per SM,
            132 on an H100/H200; twoshot_pipe 64 -> 2 per SM; multimem 40 -> 3 per SM) run in
            later waves and rely on both GPUs dispatching blocks in index order, as the default
            256 already does; another kernel holding SMs at the same time shrinks the first wave.
            Oneshot and lamport keep their own grids.
    """

    def __init__(self, heap: SymmetricHeap, algo: str = "auto", *, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout_s: float = 10.0, pdl: bool = True, blocks: int | None = None):
        if algo not in ALGOS:
            raise AllReduceError(f"algo={algo!r}: expected one of {ALGOS}")
        self.blocks = check_blocks(blocks)
        if max_bytes <= 0 or max_bytes % VEC_BYTES:
            raise AllReduceError(f"max_bytes={max_bytes}: expected a positive multiple of {VEC_BYTES}")
        self.heap = heap
        self.group = heap.group
        self.rank, self.world = heap.rank, heap.world_size
        self.device = heap.device
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.pdl = bool(pdl)
        self.multicast = heap.capabilities.multicast_enabled
        self._chosen: dict = {}
        self.sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                    if self.device.type == "cuda" else None)
        if self.device.type == "cpu":
            if algo not in ("auto", "reference"):
                raise AllReduceError(f"algo={algo!r} needs a CUDA heap; a CPU heap runs 'reference'")
            self.algo = "reference"
            log.info("AllReduce: rank %d/%d on CPU: torch.distributed reference", self.rank, self.world)
            return
        if algo == "reference":
            raise AllReduceError("algo='reference' is the CPU path; on GPU use 'nccl' for torch.distributed")
        if algo == "multimem" and not self.multicast:
            raise AllReduceError("algo='multimem' needs a heap created with enable_multicast=True on a "
                                 "device that reports multicast")
        if algo in KERNEL_ALGOS and self.world > MAX_WORLD:
            raise AllReduceError(f"algo={algo!r} supports at most {MAX_WORLD} ranks, group has {self.world}")
        self.algo = algo
        off = {name: heap.alloc(n) for name, n in heap_regions(self.world, max_bytes)}
        self.ws_off, self.flag_off, self.state_off = off["ws"], off["flag"], off["state"]
        self.pipe_flag_off, self.lam_off, self.lam_state_off = off["pipe_flag"], off["lam"], off["lam_state"]
        self.lam_cap = min(max_bytes, LAMPORT_MAX_BYTES)
        heap.buffer(self.lam_off, (3 * self.world * self.lam_cap // 4,), torch.int32).fill_(LAMPORT_SENTINEL)
        self._lam_state_addr = heap.buffer(self.lam_state_off, (LAMPORT_EPOCHS + MAX_BLOCKS,), torch.int32).data_ptr()
        self._err = torch.zeros(4, dtype=torch.int32, pin_memory=True)  # written by kernels (UVA)
        self._kernels: dict = {}
        heap.barrier()
        log.info("AllReduce: rank %d/%d on %s, algo=%s, max_bytes=%d, multicast=%s, blocks=%s", self.rank,
                 self.world, self.device, algo, max_bytes, self.multicast, self.blocks or "default")

    # --- public API -------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of `x` over the ranks; `out` (same shape/dtype, may be x itself) or a new tensor."""
        self._check_input(x, "x")
        if out is not None:
            self._check_input(out, "out")
            if out.shape != x.shape or out.dtype != x.dtype:
                raise AllReduceError(f"out {tuple(out.shape)}/{out.dtype} does not match x {tuple(x.shape)}/{x.dtype}")
        algo = self.algo_for(x, out)
        if algo == "reference":
            y = reference_all_reduce(x, self.group)
            return out.copy_(y) if out is not None else y
        if algo == "nccl":
            y = out if out is not None else torch.empty_like(x)
            if y.data_ptr() != x.data_ptr():
                y.copy_(x)
            dist.all_reduce(y, group=self.group)
            return y
        self.check()
        out = out if out is not None else torch.empty_like(x)
        if algo in ("twoshot", "twoshot_push"):
            xo, oo = self.heap.offset_of(x), self.heap.offset_of(out)
            algo = heap_kernel(algo, xo, oo, x.numel() * x.element_size())
            if algo == "twoshot_symm":
                return self._launch_symm(x, out, xo, oo)
        return self._launch(algo, x, out)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """All-reduce x [T, H], add residual [T, H], RMSNorm with weight [H].

        Returns (normed [T, H], new residual [T, H]) in x's dtype.
        """
        self._check_input(x, "x")
        if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
            raise AllReduceError(f"add_rmsnorm: x {tuple(x.shape)} must be [T, H] and residual "
                                 f"{tuple(residual.shape)}/{residual.dtype} must match it")
        if weight.shape != (x.shape[1],):
            raise AllReduceError(f"add_rmsnorm: weight shape {tuple(weight.shape)} != ({x.shape[1]},)")
        if not eps > 0:
            raise AllReduceError(f"add_rmsnorm: eps={eps!r} must be > 0")
        if weight.dtype != x.dtype or weight.device != x.device or not residual.is_contiguous():
            raise AllReduceError(f"add_rmsnorm: weight {weight.dtype}/{weight.device} must match x "
                                 f"{x.dtype}/{x.device} and residual must be contiguous")
        epv = VEC_BYTES // x.element_size()
        if self.device.type == "cuda" and x.shape[1] % epv == 0:
            algo = self.algo_for(x)
            if algo in ("oneshot", "lamport"):
                return self._launch_rmsnorm(algo, x, residual, weight.contiguous(), eps, zero_centered)
        # larger messages (or a hidden size not a multiple of 16 bytes): all-reduce, then torch ops
        s = self(x)
        res = (s.float() + residual.float()).to(x.dtype)
        return rmsnorm_reference(res, weight, eps, zero_centered), res

    def symmetric_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor in the symmetric heap (every rank must make the same calls in the same order,
        so it sits at the same offset everywhere). Two-shot with x and out both such tensors
        skips the staging copies: twoshot's owners read x and write out over NVLink,
        twoshot_push's ranks push x to the owners, which write out (x itself for in place)."""
        n = 1
        for d in (shape,) if isinstance(shape, int) else shape:
            n *= d
        off = self.heap.alloc(max(1, n) * torch.empty((), dtype=dtype).element_size())
        return self.heap.buffer(off, shape, dtype)

    def algo_for(self, x: torch.Tensor, out: torch.Tensor | None = None) -> str:
        """The algorithm a call with x (and out) runs: the fixed one, or `auto`'s choice (heap
        buffers for both x and out make the two-shot range twoshot_push)."""
        nbytes = x.numel() * x.element_size()
        if self.algo != "auto":
            limit = self.lam_cap if self.algo == "lamport" else self.max_bytes
            if self.algo in KERNEL_ALGOS and self._padded_bytes(x) > limit:
                raise AllReduceError(f"{nbytes} bytes exceed this AllReduce's limit of {limit} bytes for "
                                     f"algo={self.algo!r} (max_bytes={self.max_bytes})")
            return self.algo
        in_heap = (out is not None and self.device.type == "cuda"
                   and buffers_in_heap(self.heap.offset_of(x), self.heap.offset_of(out), nbytes))
        algo = select_algo(self._padded_bytes(x), self.world, device=self.device.type, multicast=self.multicast,
                           max_bytes=self.max_bytes, in_heap=in_heap)
        key = (algo, x.dtype)
        if key not in self._chosen:
            self._chosen[key] = nbytes
            log.info("AllReduce: auto -> %s for %d bytes of %s (first time)", algo, nbytes, x.dtype)
        return algo

    def check(self) -> None:
        """Raise if a kernel reported a peer timeout (reads pinned host memory: no GPU sync)."""
        if self.device.type == "cuda" and int(self._err[0]):
            peer = int(self._err[0]) - 1
            raise AllReduceTimeoutError(f"rank {self.rank}: all-reduce wait for rank {peer} exceeded "
                                        f"timeout_s={self.timeout_s}; the heap's flags are no longer "
                                        f"consistent, recreate the AllReduce")

    def destroy(self) -> None:
        """Drop kernel handles; the heap (owned by the caller) stays."""
        self._kernels.clear()

    # --- internals --------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor, what: str):
        if not isinstance(x, torch.Tensor):
            raise AllReduceError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in DTYPES:
            raise AllReduceError(f"{what}.dtype={x.dtype}: expected one of {list(DTYPES)}")
        if x.device != self.device:
            raise AllReduceError(f"{what}.device={x.device}: this AllReduce's heap is on {self.device}")
        if not x.is_contiguous():
            raise AllReduceError(f"{what} must be contiguous (shape {tuple(x.shape)}, stride {x.stride()})")

    def _padded_bytes(self, x: torch.Tensor) -> int:
        nbytes = x.numel() * x.element_size()
        return -(-nbytes // VEC_BYTES) * VEC_BYTES

    def _kernel(self, algo: str, dtype: torch.dtype):
        key = (algo, dtype)
        if key not in self._kernels:
            import aot
            self._kernels[key] = aot.function(KERNEL_MODULE, f"allreduce_{algo}_{DTYPES[dtype]}",
                                              aot.device_arch(self.device.index))
        return self._kernels[key]

    def _call(self, fn, *args):
        """Launch on torch's current stream (explicitly so on a side/capture stream)."""
        if torch.cuda.current_stream(self.device).cuda_stream == 0:
            return fn(*args)
        import tvm_ffi
        with tvm_ffi.use_torch_stream():
            return fn(*args)

    def _pdl(self) -> int:
        """1: launch the kernel with PDL (when enabled and `aot.launch.stream_allows_pdl`)."""
        return int(self.pdl and stream_allows_pdl(self.device))

    def _launch(self, algo: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        epv = VEC_BYTES // x.element_size()
        n = x.numel()
        xf, of = x.view(-1), out.view(-1)  # [N]
        if n % epv:  # odd length: pad to whole 16-byte vectors (one extra copy each way)
            npad = n + epv - n % epv
            xf = torch.nn.functional.pad(xf, (0, npad - n))
            of = torch.empty_like(xf)
        nvec = xf.numel() // epv
        if algo in ("oneshot", "lamport"):
            nblocks = max(1, min(MAX_BLOCKS, -(-nvec // THREADS)))
        else:
            nblocks = twoshot_grid(algo, nvec, self.world, self.blocks, self.sms)
            if algo == "twoshot_pipe":
                pipe_tiles(nvec, self.world, nblocks)
        if algo == "lamport":
            args = [xf, of, self.heap.peer_ptrs, self.rank, self.world, self.lam_off, self.lam_cap,
                    self._lam_state_addr, self._err.data_ptr(), int(self.timeout_s * 1e9)]
        else:
            flags = self.pipe_flag_off if algo == "twoshot_pipe" else self.flag_off
            args = [xf, of, self.heap.peer_ptrs, self.rank, self.world, self.ws_off, self.max_bytes, flags,
                    self.state_off, self._err.data_ptr(), int(self.timeout_s * 1e9)]
        if algo in ("twoshot", "twoshot_push", "multimem"):
            args.append(self.heap.multicast_ptr)  # used by multimem only
        args.append(nblocks)
        if algo == "lamport":
            args.append(self._pdl())
        self._call(self._kernel(algo, x.dtype), *args)
        if of.data_ptr() != out.data_ptr():
            out.view(-1).copy_(of[:n])
        return out

    def _launch_symm(self, x, out, x_off, o_off):
        nblocks = twoshot_grid("twoshot_symm", x.numel() * x.element_size() // VEC_BYTES, self.world, self.blocks)
        self._call(self._kernel("twoshot_symm", x.dtype), x.view(-1), out.view(-1), self.heap.peer_ptrs, self.rank,
                   self.world, x_off, o_off, self.flag_off, self.state_off, self._err.data_ptr(),
                   int(self.timeout_s * 1e9), nblocks)
        return out

    def _launch_rmsnorm(self, algo, x, residual, weight, eps, zero_centered):
        self.check()
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        nblocks = max(1, min(MAX_BLOCKS, x.shape[0]))
        if algo == "lamport":
            name, region = "lamport_rmsnorm", (self.lam_off, self.lam_cap, 0, self.lam_state_off)
        else:
            name, region = "rmsnorm", (self.ws_off, self.max_bytes, self.flag_off, self.state_off)
        pdl = self._pdl() if algo == "lamport" else 0
        self._call(
            self._kernel(name, x.dtype), x.view(-1), residual.view(-1), weight, out.view(-1), res_out.view(-1),
            self.heap.peer_ptrs, self.rank, self.world, *region, self._err.data_ptr(), int(self.timeout_s * 1e9),
            float(eps), 1.0 if zero_centered else 0.0, nblocks, pdl)
        return out, res_out
