"""Temporary: the smem GEMV against fp32 torch (o_proj shape), graph replay."""
import os, torch
from nvl72.model import fused_triton as ft
torch.manual_seed(0)
for r in ("16", "8"):
    os.environ["XGEMV"] = r
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = (x.float() @ w.float().T)
    out = ft.gemv(x, w)
    torch.cuda.synchronize()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            o2 = ft.gemv(x, w)
    x.copy_(torch.randn_like(x)); g.replay(); torch.cuda.synchronize()
    rel2 = ((o2.float() - x.float() @ w.float().T).norm() / (x.float() @ w.float().T).norm()).item()
    print(f"XGEMV r={r}: rel {rel:.2e}, graph replay rel {rel2:.2e}", "OK" if rel < 1e-2 and rel2 < 1e-2 else "FAIL")
