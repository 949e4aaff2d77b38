"""Sampler against direct torch computations: masks, penalties, seeds, logprobs."""
import pytest
import torch

from nvl72.engine.engine import InvalidRequest
from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.engine.sampler import SampleRow, Sampler, apply_penalties, filter_logits
from tests.engine.tiny import drain, make_engine, prompts

V = 64


def _logits(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def _kept_reference(row, temperature, top_k, top_p, min_p):
    """Indices surviving min-p, then top-k, then top-p, computed one row at a time in plain torch."""
    p = torch.softmax(row / temperature, -1)
    keep = set(torch.nonzero(p >= min_p * p.max()).flatten().tolist())
    order = [i for i in torch.argsort(row, descending=True).tolist() if i in keep]
    if top_k > 0:
        order = order[:top_k]
    mass = torch.softmax(row[order] / temperature, -1)
    out, acc = [], 0.0
    for i, m in zip(order, mass.tolist()):
        out.append(i)
        acc += m
        if acc >= top_p:
            break
    return set(out)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, -1, 0.6, 0.0), (1.0, -1, 1.0, 0.2), (0.5, 10, 0.8, 0.05),
    (2.0, 1, 0.3, 0.0),
])
def test_masks_match_reference(temperature, top_k, top_p, min_p):
    x = _logits(8, seed=top_k + 7)
    n = x.shape[0]
    got = filter_logits(x, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p),
                        torch.full((n,), min_p))
    for i in range(n):
        kept = set(torch.nonzero(torch.isfinite(got[i])).flatten().tolist())
        assert kept == _kept_reference(x[i], temperature, top_k, top_p, min_p), i
        assert torch.allclose(got[i][list(kept)], x[i][list(kept)] / temperature)


def test_penalties_match_reference():
    x = _logits(3, seed=3)
    prompt, out = [1, 2, 3, 3], [3, 5, 5, 5, 9]
    ps = [SamplingParams(repetition_penalty=1.7), SamplingParams(frequency_penalty=0.4, presence_penalty=0.9),
          SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3)]
    got = apply_penalties(x, [SampleRow(p, prompt + out, len(prompt)) for p in ps])
    # Draft tokens before a verify position count as generated.
    split = apply_penalties(x, [SampleRow(p, prompt + out[:-2], len(prompt), extra=out[-2:]) for p in ps])
    assert torch.equal(split, got)
    for i, p in enumerate(ps):
        want = x[i].clone()
        for t in set(prompt + out):
            want[t] = want[t] / p.repetition_penalty if want[t] > 0 else want[t] * p.repetition_penalty
        for t in set(out):
            want[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        assert torch.allclose(got[i], want), i


def test_greedy_and_logprobs():
    x = _logits(4, seed=5)
    rows = [SampleRow(SamplingParams(temperature=0.0, logprobs=3), [1], 1)] * 4
    res = Sampler()(x, rows)
    assert res.token_ids == x.argmax(-1).tolist()
    lp = torch.log_softmax(x, -1)
    for i in range(4):
        assert res.logprobs[i] == pytest.approx(lp[i, res.token_ids[i]].item(), abs=1e-6)
        vals, ids = lp[i].topk(3)
        assert [t for t, _ in res.top_logprobs[i]] == ids.tolist()
        assert [v for _, v in res.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-6)


def test_greedy_fast_path_on_bf16_logits_equals_fp32():
    """All-greedy batches take the argmax of the model's bf16 logits directly: the same tokens as the
    fp32 path, ties (equal bf16 values) included; a greedy row with a penalty still goes through it."""
    x = _logits(6, seed=7).to(torch.bfloat16)
    x[2, 5] = x[2, 9] = x[2].max() + 1  # a tie: the first index wins either way
    greedy = [SampleRow(SamplingParams(temperature=0.0), [1], 1) for _ in range(6)]
    res = Sampler()(x, greedy)
    assert res.token_ids == x.float().argmax(-1).tolist() and res.token_ids[2] == 5 and res.logprobs is None
    penal = greedy[:2] + [SampleRow(SamplingParams(temperature=0.0, repetition_penalty=5.0), [5], 1)] + greedy[3:]
    assert Sampler()(x, penal).token_ids[2] == 9  # token 5 (positive) divided by the penalty
    # the decode graphs' argmax: taken as is for an all-greedy batch, not used otherwise
    given = torch.arange(6)
    assert Sampler().sample(x, greedy, given).token_ids is given
    assert Sampler()(x, penal, given).token_ids[2] == 9


def test_seed_reproducible_and_distribution():
    x = _logits(1, seed=9)
    p = SamplingParams(temperature=0.8, top_k=12, seed=None)
    n = 4000

    def draw(seed0):
        rows = [SampleRow(p, [], 0, torch.Generator().manual_seed(seed0 + i)) for i in range(n)]
        return torch.tensor(Sampler()(x.expand(n, V), rows).token_ids)
    a, b, c = draw(0), draw(0), draw(10_000)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    probs = torch.softmax(filter_logits(x, torch.tensor([0.8]), torch.tensor([12]), torch.tensor([1.0]),
                                        torch.tensor([0.0]))[0], -1)
    freq = torch.bincount(a, minlength=V).float() / n
    assert (freq[probs == 0] == 0).all()
    assert (freq - probs).abs().max() < 0.03


def test_seeded_request_independent_of_batch():
    """A seeded request gets the same tokens whatever else runs beside it."""
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    ps = prompts(5, seed=4)
    alone = make_engine("qwen3_moe")
    alone.add_request(AddRequest("s", ps[0], sp))
    want = drain(alone)["s"][0]
    mixed = make_engine("qwen3_moe")
    for i, p in enumerate(ps[1:]):
        mixed.add_request(AddRequest(f"o{i}", p, SamplingParams(max_tokens=6, temperature=1.0)))
    mixed.add_request(AddRequest("s", ps[0], sp))
    assert drain(mixed)["s"][0] == want
    other = make_engine("qwen3_moe")
    other.add_request(AddRequest("s", ps[0], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99)))
    assert drain(other)["s"][0] != want


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("top_p", 0.0), ("top_k", 0), ("min_p", 1.5),
                                         ("max_tokens", 0), ("repetition_penalty", 0.0), ("logprobs", 50)])
def test_bad_sampling_values_named(field, value):
    e = make_engine("qwen3_moe")
    with pytest.raises(InvalidRequest, match=f"{field}={value!r}"):
        e.add_request(AddRequest("x", [1, 2], SamplingParams(**{field: value})))


def test_bad_prompts_named():
    e = make_engine("qwen3_moe", max_model_len=16)
    with pytest.raises(InvalidRequest, match="token id 500"):
        e.add_request(AddRequest("x", [1, 500], SamplingParams()))
    with pytest.raises(InvalidRequest, match="16"):
        e.add_request(AddRequest("y", list(range(1, 17)), SamplingParams()))
    e.add_request(AddRequest("z", [1], SamplingParams()))
    with pytest.raises(InvalidRequest, match="duplicate request_id 'z'"):
        e.add_request(AddRequest("z", [1], SamplingParams()))
