"""The engine on a CUDA device: same greedy tokens as on the CPU (fp32, reference MoE), exact
speculation with the MTP head, seeded sampling reproducible; then a bf16 throughput figure for
the embedded default model (printed, for the record)."""
import os
import time

import pytest
import torch

from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.engine.spec import MTPDrafter
from tests.engine.tiny import build_tiny, drain, make_engine, prompts, run_all

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(autouse=True)
def reference_moe(monkeypatch):
    monkeypatch.setenv("NVL72_MOE_BACKEND", "reference")


def tokens(res):
    return {k: v[0] for k, v in res.items()}


@pytest.mark.parametrize("fam", ["qwen3_moe", "qwen3_next"])
def test_cuda_matches_cpu(fam):
    ps = prompts(6, seed=11)
    cpu = tokens(run_all(make_engine(fam, model=build_tiny(fam)), ps, GREEDY))
    model = build_tiny(fam, "cuda")
    batched = tokens(run_all(make_engine(fam, model=model, max_num_batched_tokens=9), ps, GREEDY))
    assert batched == cpu
    if fam == "qwen3_next":
        spec = make_engine(fam, model=model, drafter=MTPDrafter(2), num_speculative_tokens=2)
        assert tokens(run_all(spec, ps, GREEDY)) == cpu
        assert spec.stats()["spec_decode_num_draft_tokens"] > 0
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=5)
    a, b = (make_engine(fam, model=model) for _ in range(2))
    a.add_request(AddRequest("s", ps[0], sp))
    for i, p in enumerate(ps[1:]):
        b.add_request(AddRequest(f"o{i}", p, GREEDY))
    b.add_request(AddRequest("s", ps[0], sp))
    assert drain(a)["s"][0] == drain(b)["s"][0]


@pytest.mark.parametrize("k", [0, 2])
def test_default_model_throughput(monkeypatch, k):
    """Decode throughput of the embedded default model, bf16, 64 concurrent requests."""
    from nvl72.engine.core import build_engine

    monkeypatch.setenv("NVL72_MOE_BACKEND", os.environ.get("BENCH_MOE_BACKEND", "torch-grouped"))
    engine = build_engine(None, device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=64,
                          max_num_batched_tokens=4096, num_speculative_tokens=k, kv_cache_bytes=2 << 30)
    g = torch.Generator().manual_seed(0)
    for i in range(64):
        engine.add_request(AddRequest(f"w{i}", torch.randint(1000, 200000, (128,), generator=g).tolist(),
                                      SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    drain(engine)  # warm-up
    for i in range(64):
        engine.add_request(AddRequest(f"r{i}", torch.randint(1000, 200000, (128,), generator=g).tolist(),
                                      SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)))
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = drain(engine)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    st = engine.stats()
    assert all(len(v[0]) == 128 for v in res.values())
    print(f"\nENGINE k={k}: 64 req x (128 in, 128 out) in {dt:.2f} s = {64 * 128 / dt:.0f} out tok/s, "
          f"{st['spec_decode_tokens_per_step']:.2f} tok/verify-step, acceptance {st['spec_decode_acceptance_rate']:.2f}, "
          f"steps {engine.counters['num_steps']}")
