"""DP-attention + EP model == the single-rank model on each rank's own batch (fp32, CPU, gloo).

EP=2 and EP=4 worlds of tests/dist/dp_ep_worker.py load tiny transformers checkpoints with experts
split over the world and MoE layers through `comms.DispatchCombine` (dp_ep, torch.distributed
reference). Every rank serves different sequences (different prompt lengths, one rank starting a
sequence mid-run, mixed prefill+decode steps) and sits some steps out with an idle forward (zero
tokens, still in every MoE layer's dispatch/combine, the others' tokens still reach its experts).
Each rank's logits over its active steps must equal the single-rank model running that rank's
batches alone. Cases: qwen3_moe (a dense-MLP layer between MoE layers) and qwen3_next (GDN,
shared expert, MTP drafts in the prefill and last step, idle MTP passes on idle ranks), and
qwen3_next with a different number of chained MTP drafts per rank and step, matched by
`dp_ep.PassSync` (the lockstep an engine step needs)."""
import json
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from nvl72.model.loader import load_model
from nvl72.model.parallel_layout import LayoutError, ParallelLayout
from tests.dist.dp_ep_worker import dp_script
from tests.dist.test_tp_model import write_checkpoint
from tests.dist.workers import Workers
from tests.model.tiny import rel_err

TOL = 1e-5
WORKER_TIMEOUT_S = 120
VOCAB = 256

# name -> (family, checkpoint overrides, MTP head, PassSync: ranks run different MTP draft counts)
CASES = {
    "dpep-qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=2), False, False),
    "dpep-qwen3_next-mtp": ("qwen3_next", dict(num_key_value_heads=1), True, False),
    "dpep-qwen3_next-mtp-sync": ("qwen3_next", dict(num_key_value_heads=2), True, True),
}
PROMPTS = {0: (13, 6), 1: (21,), 3: (5,)}  # rank -> prompt lengths of the first step (rank 2: none)
IDLE = {1: {1}, 2: {0}, 3: {3}}  # step -> ranks with nothing to do (beyond the ones without sequences)
LATE = {1: 7, 2: 9}  # rank -> length of a prompt that joins step 2 beside its decodes


def make_steps(world: int, mtp: bool, seed: int, sync: bool = False) -> list[dict]:
    """Four steps; per step each rank's chunks [(seq_id, tokens)] (empty: idle) and MTP draft
    counts (with `mtp`: one on every rank in the first and last step; with `sync`, (rank + step) % 3
    in every step)."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    seqs = {r: [] for r in range(world)}
    steps = []
    for s in range(4):
        chunks = {r: [] for r in range(world)}
        for r in range(world):
            if r in IDLE.get(s, ()):
                continue
            chunks[r] = [(sid, tokens(1)) for sid in seqs[r]]
            new = PROMPTS.get(r, ()) if s == 0 else ((LATE[r],) if s == 2 and r in LATE else ())
            for n in new:
                seqs[r].append(len(seqs[r]))
                chunks[r].append((seqs[r][-1], tokens(n)))
        drafts = [(r + s) % 3 if sync else int(mtp and s in (0, 3)) for r in range(world)]
        steps.append(dict(chunks=[chunks[r] for r in range(world)], mtp=drafts))
    return steps


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def runs(request, tmp_path_factory):
    """(world, {case: ([reference logits per rank], [logits of each rank])})."""
    world = request.param
    root = tmp_path_factory.mktemp(f"dpep{world}")
    cases = [dict(name=n, path=str(write_checkpoint(root, n, f, o, False, mtp)), sync=sync,
                  steps=make_steps(world, mtp, seed=len(n) + world, sync=sync))
             for n, (f, o, mtp, sync) in CASES.items()]
    spec = root / "cases.json"
    spec.write_text(json.dumps(dict(cases=cases)))
    with Workers("tests/dist/dp_ep_worker.py", spec, root, world) as workers:
        refs = {}
        with torch.no_grad():  # the single-rank references, while the workers run
            for c in cases:
                model = load_model(c["path"], dtype=torch.float32, device="cpu")
                refs[c["name"]] = [dp_script(model, c["steps"], r) for r in range(world)]
        outputs = workers.join(WORKER_TIMEOUT_S)
    idle = sum(int(n) for text in outputs for n in re.findall(r"ran (\d+) idle passes", text))
    assert idle > 0, "PassSync matched no differing pass counts: the sync case tests nothing"
    return world, {n: (refs[n], [load_file(str(root / f"{n}.rank{r}.safetensors"))["logits"] for r in range(world)])
                   for n in CASES}


@pytest.mark.mp
@pytest.mark.parametrize("case", list(CASES))
def test_dp_ep_logits_equal_single_rank(runs, case):
    world, results = runs
    refs, ranks = results[case]
    for r, (ref, got) in enumerate(zip(refs, ranks)):
        assert ref.shape[0] > 0 and got.shape == ref.shape, f"{case} rank {r}: {tuple(got.shape)} vs {tuple(ref.shape)}"
        assert rel_err(got, ref) < TOL, f"{case} EP{world} rank {r}: rel err {rel_err(got, ref):.2e}"
    # the ranks served different batches: the test would not notice a rank computing another's tokens
    assert len({tuple(t.shape) for t in ranks}) > 1 or not torch.equal(ranks[0], ranks[1])


def test_make_steps_has_idle_and_mixed_steps():
    """The script exercises what the module claims: idle steps, a rank with no sequence until
    step 2, a step mixing a new prompt with decodes, different batches per rank."""
    steps = make_steps(4, False, seed=0)
    lens = [[[len(t) for _, t in s["chunks"][r]] for r in range(4)] for s in steps]
    assert lens[0] == [[13, 6], [21], [], [5]]
    assert lens[1] == [[1, 1], [], [], [1]]  # rank 1 idle; rank 2 has no sequence yet
    assert lens[2] == [[], [1, 7], [9], [1]]  # rank 0 idle; ranks 1, 2 start prompts (rank 1 beside a decode)
    assert lens[3] == [[1, 1], [1, 1], [1], []]
    assert [s["mtp"] for s in make_steps(2, True, seed=0)] == [[1, 1], [0, 0], [0, 0], [1, 1]]
    assert [s["mtp"] for s in make_steps(2, True, seed=0, sync=True)] == [[0, 1], [1, 2], [2, 0], [0, 1]]


def test_layout_rejects_dispatch_that_does_not_fit():
    """A dispatch with TP > 1, of another mode, or over a group other than the EP ranks."""
    dc = SimpleNamespace(mode="dp_ep", rank=1, world=2)
    assert ParallelLayout(ep_rank=1, ep_size=2, dispatch=dc).dispatch is dc
    with pytest.raises(LayoutError, match="tp_size=2"):
        ParallelLayout(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2, all_reduce=lambda x: x, dispatch=dc)
    with pytest.raises(LayoutError, match="'replicated'"):
        ParallelLayout(ep_rank=1, ep_size=2, dispatch=SimpleNamespace(mode="replicated", rank=1, world=2))
    with pytest.raises(LayoutError, match="ep_rank=0, ep_size=2"):
        ParallelLayout(ep_rank=0, ep_size=2, dispatch=dc)
