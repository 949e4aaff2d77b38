"""What one dependent-kernel boundary of a decode chain costs, by how the consumer learns that its
input is complete (issue #4: a batch-1 layer is ~8 such boundaries around ~18 us of weight bytes).

    python3 tests/runner/gpu_handoff_bench.py [--chain 48] [--programs 132,528] [--weight-kb 0,64]

A CUDA graph of `--chain` kernels, each of P programs: program p reads its own weight slice
(`--weight-kb` per program, loaded before any wait, as the decode GEMVs stream theirs), then the
previous kernel's P outputs (all of them, as a GEMV after a GEMV needs the whole vector), and
writes one value. Handoffs:
  plain: ordinary launches (stream order);
  pdl: PDL, `griddepcontrol.wait` (the previous grid COMPLETED and flushed), then launch_dependents
       (the engine's kernels);
  pdl_trigger_first: PDL, launch_dependents at the start, then the wait;
  flag: PDL, launch_dependents at the start, then a poll (`ld.acquire.gpu`) of an arrival counter
        the previous kernel's programs bump (`atom.add.release.gpu`) after their stores; no wait;
  flag_sleep: the same with a `nanosleep` of ~100 ns between polls (fewer polls competing with the
        stores they wait for);
  flag_after: as flag, launch_dependents only once the poll passed (flag and flag_sleep trigger first, so
        every later kernel of the chain may launch and poll at once: up to 16 such grids fit an SM's
        threads, all polling);
  flag_one: as flag_after, one thread polling (the others wait at a CTA barrier, then read the counter
        once for the check);
  persistent: no boundary at all: one launch of P programs runs the whole chain, hop i's weight slice
        loaded before it polls hop i-1's arrival counter (a grid barrier a hop: the cost a persistent
        decode layer pays instead of a launch);
  persistent_one: the same, one thread polling.
Time per boundary = median replay / chain. Every mode's outputs are checked against a torch
recomputation. Prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.moe.gpu_layer_profile import capture, median_us  # noqa: E402

MODES = {"plain": 0, "pdl": 1, "pdl_trigger_first": 2, "flag": 3, "flag_sleep": 4, "flag_after": 5, "flag_one": 6,
         "persistent": 7, "persistent_one": 8}
PERSISTENT = 7
POLL_LIMIT = tl.constexpr(1 << 24)  # polls before a program gives up (writes NaN: the check fails, nothing hangs)


@triton.jit
def _ld_acquire(p):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [p], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _poll_thread0(p, target):
    """Thread 0 polls *p (`ld.acquire.gpu`) until it reaches `target` or POLL_LIMIT polls; other threads
    return at once (a CTA barrier after this makes thread 0's acquire theirs)."""
    return tl.inline_asm_elementwise(
        "{\n .reg .pred q;\n .reg .u32 t, n;\n .reg .s32 seen;\n mov.u32 t, %tid.x;\n mov.s32 $0, 0;\n"
        " setp.ne.u32 q, t, 0;\n @q bra POLL_END;\n mov.u32 n, 0;\n"
        "POLL_AGAIN:\n ld.acquire.gpu.global.b32 seen, [$1];\n setp.ge.s32 q, seen, $2;\n @q bra POLL_END;\n"
        " add.u32 n, n, 1;\n setp.lt.u32 q, n, 16777216;\n @q bra POLL_AGAIN;\n"
        "POLL_END:\n}", "=r,l,r", [p, target], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _nap():
    tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _hop(prev, out, w, cnt_in, cnt_out, ep, w_words, P: tl.constexpr, PB: tl.constexpr, WBLOCK: tl.constexpr,
         MODE: tl.constexpr):
    pid = tl.program_id(0)
    accw = tl.zeros([WBLOCK], tl.float32)
    if WBLOCK > 1:
        base = w + pid.to(tl.int64) * w_words
        c = tl.arange(0, WBLOCK)
        for k0 in range(0, w_words, WBLOCK):
            accw += tl.load(base + k0 + c)
    ok = True
    if MODE == 1:
        gdc_wait()
        gdc_launch_dependents()
    if MODE == 2:
        gdc_launch_dependents()
        gdc_wait()
    if MODE == 3 or MODE == 4:
        gdc_launch_dependents()
    if MODE >= 3:
        target = tl.load(ep) * P
        if MODE == 6:
            _poll_thread0(cnt_in, target)
            tl.debug_barrier()
            seen = _ld_acquire(cnt_in)
        else:
            seen = _ld_acquire(cnt_in)
            n = 0
            while (seen < target) & (n < POLL_LIMIT):
                if MODE == 4:
                    _nap()
                seen = _ld_acquire(cnt_in)
                n += 1
        ok = seen >= target
    if MODE >= 5:
        gdc_launch_dependents()
    v = tl.load(prev + tl.arange(0, PB), mask=tl.arange(0, PB) < P, other=0.0, cache_modifier=".cg")
    s = tl.sum(v, 0) * (1.0 / P) + tl.sum(accw, 0) + pid
    tl.store(out + pid, tl.where(ok, s, float("nan")))
    if MODE >= 3:
        tl.debug_barrier()  # every thread's store precedes the release
        tl.atomic_add(cnt_out, 1, sem="release", scope="gpu")


@triton.jit
def _chain(outs, w, cnt, ep, chain, w_words, P: tl.constexpr, PB: tl.constexpr, WBLOCK: tl.constexpr,
           ONE: tl.constexpr):
    """The whole chain in one launch: outs[0] is the seed, hop i writes outs[i + 1] and bumps cnt[i + 1]."""
    pid = tl.program_id(0)
    target = tl.load(ep) * P
    for i in range(chain):
        accw = tl.zeros([WBLOCK], tl.float32)
        if WBLOCK > 1:
            base = w + i.to(tl.int64) * P * w_words + pid.to(tl.int64) * w_words
            c = tl.arange(0, WBLOCK)
            for k0 in range(0, w_words, WBLOCK):
                accw += tl.load(base + k0 + c)
        if ONE:
            _poll_thread0(cnt + i, target)
            tl.debug_barrier()
            seen = _ld_acquire(cnt + i)
        else:
            seen = _ld_acquire(cnt + i)
            n = 0
            while (seen < target) & (n < POLL_LIMIT):
                seen = _ld_acquire(cnt + i)
                n += 1
        ok = seen >= target
        v = tl.load(outs + i * P + tl.arange(0, PB), mask=tl.arange(0, PB) < P, other=0.0, cache_modifier=".cg")
        s = tl.sum(v, 0) * (1.0 / P) + tl.sum(accw, 0) + pid
        tl.store(outs + (i + 1) * P + pid, tl.where(ok, s, float("nan")))
        tl.debug_barrier()
        tl.atomic_add(cnt + i + 1, 1, sem="release", scope="gpu")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chain", type=int, default=48)
    ap.add_argument("--programs", default="132,528")
    ap.add_argument("--weight-kb", default="0,64", help="KB of weight each program streams before its handoff")
    ap.add_argument("--replays", type=int, default=200)
    a = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}: chain of {a.chain}")
    rows = []
    for P in (int(v) for v in a.programs.split(",")):
        for wkb in (int(v) for v in a.weight_kb.split(",")):
            w_words = wkb * 256
            WBLOCK = 1024 if w_words else 1
            w = torch.randn(a.chain, max(P * w_words, 1), device="cuda") * 1e-3
            seed = torch.randn(P, device="cuda")
            for mode, code in MODES.items():
                buf = torch.empty(a.chain + 1, P, device="cuda")
                buf[0] = seed
                outs = buf[1:]
                cnt = torch.zeros(a.chain + 1, dtype=torch.int32, device="cuda")
                cnt[0] = 2**31 - 1  # the chain's first input is always complete
                ep = torch.ones(1, dtype=torch.int32, device="cuda")

                def chain():
                    if code >= PERSISTENT:
                        _chain[(P,)](buf, w, cnt, ep, a.chain, w_words, P=P,
                                     PB=triton.next_power_of_2(P), WBLOCK=WBLOCK, ONE=code == PERSISTENT + 1,
                                     num_warps=4)
                        ep.add_(1)
                        return
                    for i in range(a.chain):
                        _hop[(P,)](seed if i == 0 else outs[i - 1], outs[i], w[i], cnt[i], cnt[i + 1], ep, w_words,
                                   P=P, PB=triton.next_power_of_2(P), WBLOCK=WBLOCK, MODE=code, launch_pdl=code > 0, num_warps=4)
                    ep.add_(1)  # the next run's counters must reach one more P each

                outs.fill_(float("nan"))
                g = capture(chain)
                us = median_us(g, a.replays)
                outs.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                want, x = [], seed
                ids = torch.arange(P, device="cuda", dtype=torch.float32)
                for i in range(a.chain):
                    x = x.sum() / P + (w[i][:P * w_words].view(P, -1).sum(1) if w_words else 0) + ids
                    want.append(x)
                err = ((outs - torch.stack(want)).abs().max() / torch.stack(want).abs().max()).item()
                rows.append((P, wkb, mode, us / a.chain, err))
                print("row", *rows[-1], flush=True)
    print(f"{'programs':>8} {'weight KB':>9} {'handoff':>18} {'us/kernel':>10} {'rel err':>9}")
    for P, wkb, mode, us, err in rows:
        print(f"{P:>8} {wkb:>9} {mode:>18} {us:>10.2f} {err:>9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
