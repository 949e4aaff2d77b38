"""Temporary: the smem GEMVs against fp32 torch and Triton's (o_proj, q/k/v with the norm), graph replay."""
import os, torch
from nvl72.model import fused_triton as ft
torch.manual_seed(0)
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
for r in ("16", "8"):
    os.environ["XGEMV"] = r
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    out = ft.gemv(x, w)
    torch.cuda.synchronize()
    e1 = rel(out, x.float() @ w.float().T)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            o2 = ft.gemv(x, w)
    x.copy_(torch.randn_like(x)); g.replay(); torch.cuda.synchronize()
    e2 = rel(o2, x.float() @ w.float().T)
    print(f"XGEMV r={r}: rel {e1:.2e}, graph replay rel {e2:.2e}", "OK" if e1 < 1e-2 and e2 < 1e-2 else "FAIL")
    del os.environ["XGEMV"]
for r in ("16", "8"):
    for has_delta in (False, True):
        x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
        d = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16) if has_delta else None
        nw = (1 + 0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
        w = torch.randn(5120, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
        s_ref, o_ref = ft.norm_gemv(x, d, nw, 1e-6, False, w)  # Triton's
        os.environ["XQKV"] = r
        s_new, o_new = ft.norm_gemv(x, d, nw, 1e-6, False, w)
        torch.cuda.synchronize()
        v = x.float() + (d.float() if d is not None else 0)
        h = v * torch.rsqrt(v.pow(2).mean() + 1e-6) * nw.float()
        e_f = rel(o_new, h @ w.float().T)
        e_t = rel(o_new, o_ref)
        s_ok = torch.equal(s_new, s_ref)
        st = torch.cuda.Stream()
        with torch.cuda.stream(st):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                s2, o2 = ft.norm_gemv(x, d, nw, 1e-6, False, w)
        x.copy_(torch.randn_like(x)); g.replay(); torch.cuda.synchronize()
        del os.environ["XQKV"]
        s3, o3 = ft.norm_gemv(x, d, nw, 1e-6, False, w)
        e_g = rel(o2, o3)
        ok = e_f < 1e-2 and e_t < 1e-3 and s_ok and e_g < 1e-3 and torch.equal(s2, s3)
        print(f"XQKV r={r} delta={has_delta}: rel fp32 {e_f:.2e}, vs Triton {e_t:.2e}, sum equal {s_ok}, "
              f"graph vs Triton {e_g:.2e}", "OK" if ok else "FAIL")
