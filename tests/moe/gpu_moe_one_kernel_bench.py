import os, sys, torch
sys.path.insert(0, ".")
from moe import fused_decode
from moe.backend import load_sm90_module
from moe.kernels import triton_moe
from aot.launch import pdl_enabled
E, H, I, K, L = 128, 2048, 768, 8, 8
dev = torch.device("cuda")
mod = load_sm90_module(fused_decode.MODULE)
op = fused_decode.FusedDecode(mod)
gen = torch.Generator(device="cuda").manual_seed(0)
layers = []
for _ in range(L):
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * 0.1).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, I, device=dev, generator=gen) * 0.1).to(torch.float8_e4m3fn)
    s13 = torch.exp2(torch.randint(-8, -4, (E, 2 * I // 128, H // 128), device=dev, generator=gen).float())
    s2 = torch.exp2(torch.randint(-8, -4, (E, H // 128, I // 128), device=dev, generator=gen).float())
    logits = torch.randn(1, E, device=dev, generator=gen).to(torch.bfloat16)
    layers.append((w13, s13, w2, s2, logits))
x = torch.randn(1, H, device=dev, generator=gen).to(torch.bfloat16)
ctr = torch.zeros(1, dtype=torch.int64, device=dev)
act = torch.empty(K * I, device=dev)
ts = [torch.zeros(128 * 5, dtype=torch.int64, device=dev) for _ in layers]
def step(mode):
    for li, (w13, s13, w2, s2, logits) in enumerate(layers):
        tw, ids = triton_moe.route(logits, K, True)
        if mode == "timed":
            out = torch.empty(1, H, dtype=torch.bfloat16, device=dev)
            mod.moe_k8_h2048_i768_timed(x.view(-1), ids.view(-1), tw.view(-1), w13.view(torch.uint8).view(-1), s13.view(-1),
                w2.view(torch.uint8).view(-1), s2.view(-1), act, out.view(-1), ctr, ts[li], 0, E, int(pdl_enabled(dev)))
        else:
            os.environ["XGU_ONE"] = "1" if mode == "fused" else "0"
            op(x, tw, ids, w13, s13, w2, s2, 0)
def graph(mode):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(mode)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(mode)
    return g
gs = {m: graph(m) for m in ("two", "fused", "timed")}
for rnd in range(2):
    for m, g in gs.items():
        for _ in range(5): g.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(50): g.replay()
        b.record(); torch.cuda.synchronize()
        print(f"{m:6s} us per layer (route + MoE): {a.elapsed_time(b) * 1e3 / 50 / L:.2f}")
gs["timed"].replay(); torch.cuda.synchronize()
print("timed CTA points, us from the layer's min wait return: start / wait / units done / barrier done / end: first/median/last")
for li in range(1, L - 1):
    t = ts[li].view(128, 5).double().cpu()
    t0 = t[:, 1].min()
    cols = []
    for c in range(5):
        v = ((t[:, c] - t0) / 1e3).sort().values
        cols.append(f"{v[0]:5.1f}/{v[64]:5.1f}/{v[-1]:5.1f}")
    print(li, "  ".join(cols))
