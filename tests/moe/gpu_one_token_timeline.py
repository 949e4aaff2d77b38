"""Per-CTA %globaltimer points of the CuTeDSL one-token gate/up and down (timed variants), 8 layers of
route + gate/up + down in a CUDA graph at the Qwen3-30B-A3B expert shape (all experts local)."""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe import fused_decode  # noqa: E402
from moe.backend import load_sm90_module  # noqa: E402
from moe.kernels import triton_moe  # noqa: E402
from aot.launch import pdl_enabled  # noqa: E402
E, H, I, K, L = 128, 2048, 768, 8, 8
dev = torch.device("cuda")
mod = load_sm90_module(fused_decode.MODULE)
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
act = torch.empty(K * I, device=dev)
out = torch.empty(H, dtype=torch.bfloat16, device=dev)
tg = [torch.zeros(K * (I // 16) * 5, dtype=torch.int64, device=dev) for _ in layers]
td = [torch.zeros(H // 16 * 5, dtype=torch.int64, device=dev) for _ in layers]
pdl = int(pdl_enabled(dev))
def step(timed):
    sfx = "_timed" if timed else ""
    for li, (w13, s13, w2, s2, logits) in enumerate(layers):
        tw, ids = triton_moe.route(logits, K, True)
        getattr(mod, "gate_up_h2048" + sfx)(x.view(-1), ids.view(-1), w13.view(torch.uint8).view(-1), s13.view(-1), act,
                                           tg[li], 0, E, I, K, pdl)
        getattr(mod, "down_k8_i768" + sfx)(act, ids.view(-1), tw.view(-1), w2.view(torch.uint8).view(-1), s2.view(-1),
                                          out, td[li], 0, E, H, pdl)
def graph(timed):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(timed)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(timed)
    return g
gs = {t: graph(t) for t in (False, True)}
for t, g in gs.items():
    for _ in range(5): g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(50): g.replay()
    b.record(); torch.cuda.synchronize()
    print(f"timed={t}: us per layer (route + gate/up + down): {a.elapsed_time(b) * 1e3 / 50 / L:.2f}")
gs[True].replay(); torch.cuda.synchronize()
print("us from the layer's first gate/up wait return, first/median/last CTA")
print("layer | gate/up: start wait staged data end | down: start wait staged w2 end")
for li in range(1, L - 1):
    g5, d5 = tg[li].view(-1, 5).double().cpu(), td[li].view(-1, 5).double().cpu()
    t0 = g5[:, 1].min()
    def q(c):
        v = ((c - t0) / 1e3).sort().values
        return f"{v[0]:5.1f}/{v[len(v) // 2]:5.1f}/{v[-1]:5.1f}"
    print(li, " ".join(q(g5[:, c]) for c in range(5)), "|", " ".join(q(d5[:, c]) for c in range(5)))
