"""Our logits == transformers' on tiny random checkpoints (fp32, CPU), for every batch shape the
engine produces: whole prefills of several lengths in one batch, chunked prefill over a cached
prefix, token-by-token decode through paged KV and GDN state slots, and mixed batches."""
import pytest
import torch

from nvl72.model.loader import load_model
from tests.model.tiny import PagedRunner, hf_logits, rel_err, save_tiny

FAMILIES = ["qwen3_moe", "qwen3_next", "qwen3_5_moe"]
TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(our model, transformers model, random prompts) for one family."""
    path = tmp_path_factory.mktemp(request.param)
    ref = save_tiny(request.param, path, seed=1)
    ours = load_model(path, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 64, 70, 13)]
    refs = [hf_logits(ref, p) for p in prompts]
    return ours, prompts, refs


def test_batched_prefill_of_mixed_lengths(pair):
    """One ForwardBatch holding sequences of 1, 7, 64, 70 and 13 tokens (not multiples of the
    GDN chunk 64 nor of the page size 4)."""
    model, prompts, refs = pair
    out = PagedRunner(model, seed=3).step(list(enumerate(prompts)))
    for p, o, r in zip(prompts, out, refs):
        assert o.shape == r.shape
        assert rel_err(o, r) < TOL, f"len {len(p)}: {rel_err(o, r)}"


def test_single_sequence_prefill_matches_batched(pair):
    model, prompts, refs = pair
    for p, r in zip(prompts[2:4], refs[2:4]):
        out = PagedRunner(model, seed=4).step([(0, p)])[0]
        assert rel_err(out, r) < TOL


def test_chunked_prefill_then_decode(pair):
    """Prefix chunk, then the rest of the prompt (crossing the GDN chunk and page boundaries),
    then decode one token at a time; every step equals the full forward at those positions."""
    model, prompts, refs = pair
    p, r = prompts[3], refs[3]  # 70 tokens
    run = PagedRunner(model, seed=5)
    (a,) = run.step([(0, p[:30])])
    (b,) = run.step([(0, p[30:66])])
    assert rel_err(a, r[:30]) < TOL
    assert rel_err(b, r[30:66]) < TOL
    for t in range(66, 70):
        (c,) = run.step([(0, [p[t]])])
        assert rel_err(c, r[t : t + 1]) < TOL, f"decode at {t}"


def test_token_by_token_from_the_first_token(pair):
    """Every token its own decode step (two sequences side by side), across several pages."""
    model, prompts, refs = pair
    run = PagedRunner(model, seed=8)
    p, q = prompts[4], prompts[1]  # 13 and 7 tokens
    for t in range(len(p)):
        chunks = [(0, [p[t]])] + ([(1, [q[t]])] if t < len(q) else [])
        out = run.step(chunks)
        assert rel_err(out[0], refs[4][t : t + 1]) < TOL, f"position {t}"
        if t < len(q):
            assert rel_err(out[1], refs[1][t : t + 1]) < TOL, f"position {t}"


def test_mixed_prefill_chunks_and_decodes_in_one_batch(pair):
    """Decode tokens of two sequences beside a new prefill and a continued chunk, with page ids
    shuffled and sequences interleaved in the pool."""
    model, prompts, refs = pair
    run = PagedRunner(model, seed=6)
    run.step([(0, prompts[1][:5]), (1, prompts[2][:40]), (2, prompts[4][:12])])
    out = run.step([(2, [prompts[4][12]]), (3, prompts[3]), (0, prompts[1][5:]), (1, [prompts[2][40]])])
    want = [refs[4][12:13], refs[3], refs[1][5:], refs[2][40:41]]
    for o, w in zip(out, want):
        assert rel_err(o, w) < TOL
    out = run.step([(1, prompts[2][41:43]), (3, [prompts[4][0]])])  # a 2-token chunk beside a decode
    assert rel_err(out[0], refs[2][41:43]) < TOL


def test_page_table_is_really_used(pair):
    """Corrupting a cached page of one sequence changes its next-token logits (and only its)."""
    model, prompts, refs = pair
    run = PagedRunner(model, seed=7)
    run.step([(0, prompts[2][:20]), (1, prompts[4][:12])])
    victim = run.pages[0][1]
    for kv in run.caches.kv:
        if kv is not None:
            kv[victim].normal_()
    out = run.step([(0, [prompts[2][20]]), (1, [prompts[4][12]])])
    assert rel_err(out[0], refs[2][20:21]) > 1e-3
    assert rel_err(out[1], refs[4][12:13]) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_error_no_larger_than_transformers_own(family, tmp_path):
    """In bf16 our logits stray from the fp32 reference no more than transformers' bf16 model
    does (rounding at the same points). Every expert is routed (top-k = E) so that no routing
    flip between dtypes dominates the comparison."""
    ref = save_tiny(family, tmp_path, seed=3, num_experts_per_tok=8)
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    want = hf_logits(ref, tokens)
    hf_err = rel_err(hf_logits(ref.to(torch.bfloat16), tokens), want)
    run = PagedRunner(load_model(tmp_path, dtype=torch.bfloat16, device="cpu"), seed=5)
    out = torch.cat(run.step([(0, tokens[:36])]) + [run.step([(0, [t])])[0] for t in tokens[36:]])
    assert rel_err(out, want) < 1.25 * hf_err + 1e-3, (rel_err(out, want), hf_err)
