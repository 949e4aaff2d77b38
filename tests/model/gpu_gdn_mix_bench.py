"""One-GPU timing of a GDN layer's few-token mixer (`gdn_triton.fused_recurrent_mix`) at the Qwen3-Next
GDN shape (16 key / 32 value heads of 128, conv 4, bf16, the qwen3_next packed-projection layout) over
decode batch sizes, as the decode graphs launch it (CUDA graph, PDL), optionally beside another copy of
the module (an older commit's file: the A/B of a kernel change).

    python3 tests/model/gpu_gdn_mix_bench.py [--old PATH/gdn_triton.py] [--batches 1,8,64]

Each timed graph launches `--layers` mixers back to back, each on its own projections and state slots
(so a launch does not find the previous one's state in L2), every sequence reading and writing its own
slot as decode does; time = median replay / layers. Every module's output is first checked against the
torch ops composed in fp32 (tests/model/test_gdn_triton.py's reference). Prints the table last.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from nvl72.model import gdn_triton  # noqa: E402
from tests.model.test_gdn_triton import _mix_reference, _mix_views, rel_err  # noqa: E402
from tests.moe.gpu_layer_profile import capture, median_us  # noqa: E402

HK, HV, D, K = 16, 32, 128, 4
EPS = 1e-6


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("gdn_triton_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def layer_inputs(batch: int, gen: torch.Generator) -> dict:
    """One layer's logical projections (CPU, bf16), weights and states (slot i = sequence i)."""
    cd = 2 * HK * D + HV * D
    rnd = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    return dict(q=rnd(batch, HK, D), k=rnd(batch, HK, D), v=rnd(batch, HV, D), z=rnd(batch, HV, D), b=rnd(batch, HV),
                a=rnd(batch, HV), w=rnd(cd, K), A_log=torch.empty(HV).uniform_(0.01, 4, generator=gen).log(),
                dt_bias=rnd(HV), norm_w=(1 + 0.3 * torch.randn(D, generator=gen)).to(torch.bfloat16),
                conv=rnd(batch, cd, K - 1), state=0.1 * torch.randn(batch, HV, D, D, generator=gen))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=None, help="another gdn_triton.py to time beside this checkout's")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--layers", type=int, default=18, help="mixers a graph launches (the 24-layer shape has 18)")
    args = ap.parse_args()
    mods = [("new", gdn_triton)] + ([("old", load_module(args.old))] if args.old else [])
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        gen = torch.Generator().manual_seed(batch)
        layers = [layer_inputs(batch, gen) for _ in range(args.layers)]
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        slots = torch.arange(batch, device="cuda")  # decode: each sequence writes its own read slot
        dev = []
        for x in layers:
            views = [t.cuda() for t in _mix_views("qwen3_next", x["q"], x["k"], x["v"], x["z"], x["b"], x["a"], HK)]
            dev.append((views, [x[n].cuda() for n in ("w", "A_log", "dt_bias", "norm_w")], x["conv"].cuda(),
                        x["state"].cuda(), torch.empty(batch, HV * D, dtype=torch.bfloat16, device="cuda")))
        x = layers[0]
        ref = _mix_reference(x["q"], x["k"], x["v"], x["z"], x["b"], x["a"], x["w"], x["A_log"], x["dt_bias"],
                             x["norm_w"], EPS, x["conv"].float(), x["state"].clone(), qsl.cpu(), slots.cpu(),
                             slots.cpu())
        row = {"batch": batch}
        for name, mod in mods:
            views, weights = dev[0][:2]  # the states from the CPU copies: an earlier module's timing moved dev's
            got = mod.fused_recurrent_mix(*views, *weights, EPS, x["conv"].cuda(), x["state"].cuda(), qsl, slots, slots)
            err = rel_err(got.cpu(), ref)
            assert err < 2e-2, (name, batch, err)

            def step(m=mod):
                for views_, weights_, conv_, state_, out_ in dev:
                    m.fused_recurrent_mix(*views_, *weights_, EPS, conv_, state_, qsl, slots, slots, out=out_)

            row[name] = median_us(capture(step)) / args.layers
        rows.append(row)
        print(row, flush=True)
    print(f"\nGDN mix ({torch.cuda.get_device_name()}, {HK}/{HV} heads x {D}, conv {K}, bf16, CUDA graph of "
          f"{args.layers} launches, us per launch)")
    print("%6s %9s %9s" % ("batch", "new us", "old us"))
    for r in rows:
        print("%6d %9.2f %9s" % (r["batch"], r["new"], "%.2f" % r["old"] if "old" in r else "-"))


if __name__ == "__main__":
    main()
