"""MTP-head speculative decoding on the tiny hybrid model: exact output, drafts equal to a
from-scratch computation of the MTP head over the whole history (so its KV is maintained right)."""
import pytest
import torch

from nvl72.engine.spec import MTPDrafter
from nvl72.model.batch import ForwardBatch
from tests.engine.test_engine_exact import GREEDY, tokens
from tests.engine.tiny import make_engine, prompts, run_all, tiny_model


class RecordingMTP(MTPDrafter):
    def propose(self, inp):
        out = super().propose(inp)
        for s, w, d in zip(inp.scheduled, inp.want, out):
            if w:
                self.log.append((list(s.seq.all_ids), list(d)))
        return out


def scratch_drafts(model, history, k, page_size=4):
    """Target forward over history[:-1] with fresh caches, then the MTP chain, no engine involved."""
    n = len(history) - 1
    pages = n // page_size + k + 2
    caches = model.allocate_caches(pages, page_size, num_slots=2)
    table = torch.arange(pages, dtype=torch.int32)[None]

    def batch(ids, pos, seq_len):
        return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor([0, len(ids)], dtype=torch.int32),
                            torch.tensor([seq_len], dtype=torch.int32), table,
                            torch.tensor([1]), torch.full((len(ids),), -1), None)
    with torch.inference_mode():
        hidden = model(batch(history[:n], list(range(n)), n), caches)
        h = model.forward_mtp(batch(history[1:n + 1], list(range(n)), n), caches, hidden)[-1:]
        out = [int(model.compute_logits(h).argmax())]
        for j in range(1, k):
            h = model.forward_mtp(batch([out[-1]], [n - 1 + j], n + j), caches, h)
            out.append(int(model.compute_logits(h).argmax()))
    return out


@pytest.mark.parametrize("k,budget", [(1, 64), (3, 7)])
def test_mtp_exact_and_drafts_match_scratch(k, budget):
    ps = prompts(5, seed=2)
    ref = tokens(run_all(make_engine("qwen3_next", enable_prefix_caching=False), ps, GREEDY))
    drafter = RecordingMTP(k)
    drafter.log = []
    e = make_engine("qwen3_next", drafter=drafter, num_speculative_tokens=k, max_num_batched_tokens=budget,
                    enable_prefix_caching=False)
    assert tokens(run_all(e, ps, GREEDY)) == ref
    st = e.stats()
    assert st["spec_decode_num_draft_tokens"] > 0
    assert 0.0 <= st["spec_decode_acceptance_rate"] <= 1.0
    model = tiny_model("qwen3_next")
    for history, drafts in drafter.log[::5]:
        assert drafts == scratch_drafts(model, history, k), history


def test_mtp_with_prefix_cache_exact():
    """Second turns hit the prefix cache (MTP KV of cached pages reused): output stays exact."""
    ps = prompts(4, seed=3)
    e = make_engine("qwen3_next", drafter=MTPDrafter(2), num_speculative_tokens=2, num_state_slots=64)
    first = tokens(run_all(e, ps, GREEDY))
    turn2 = [ps[i] + first[f"r{i}"] + [5, 6] for i in range(len(ps))]
    got = run_all(e, turn2, GREEDY)
    assert sum(v[2] for v in got.values()) > 0
    assert tokens(got) == tokens(run_all(make_engine("qwen3_next", enable_prefix_caching=False), turn2, GREEDY))
