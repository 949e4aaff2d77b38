"""Tensor/expert-parallel model == the single-rank model (fp32, CPU, gloo).

Two worker processes (tests/dist/tp_worker.py) load tiny transformers checkpoints cut by a
`ParallelLayout` (TP=2 with experts split by intermediate, or TP=2 with EP=2), run a prefill of a
40-token and a 9-token sequence (GDN chunked and recurrent rules) and three decode steps through
paged KV and GDN state slots; every step's logits must equal the single-rank model's. Cases cover
num_key_value_heads=1 (each rank keeps the replicated KV head) and =2 (split), attention bias
(row-parallel bias added once), the shared expert and the dense-MLP layers, Qwen3.5's fused
expert layout, and the MTP head (drafts at every prompt position). The workers run all cases in
one world, so the processes start once; they end with a TP all-reduce that one rank joins late,
which must raise CollectiveTimeout on the other."""
import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from nvl72.model.loader import load_model
from tests.dist.tp_worker import tp_script
from tests.dist.workers import Workers
from tests.model.test_model_loader import _official_qwen35_layout, _state, _write
from tests.model.tiny import rel_err, save_tiny

WORLD = 2
TOL = 1e-5
WORKER_TIMEOUT_S = 150
PROMPTS_SEED = 7
PROMPT_LENS = (40, 9)  # GDN: chunked rule (> 16 tokens) and recurrent rule in one prefill

# name -> (family, checkpoint overrides, ep_size, fused expert layout, MTP head)
CASES = {
    "qwen3_moe-kv2-ep1": ("qwen3_moe", dict(num_key_value_heads=2), 1, False, False),
    "qwen3_moe-kv1-ep2-bias": ("qwen3_moe", dict(num_key_value_heads=1, attention_bias=True), 2, False, False),
    "qwen3_next-kv1-ep1": ("qwen3_next", dict(num_key_value_heads=1), 1, False, False),
    "qwen3_next-kv2-ep2-mtp": ("qwen3_next", dict(num_key_value_heads=2), 2, False, True),
    "qwen3_5_moe-kv1-ep1-fused": ("qwen3_5_moe", dict(num_key_value_heads=1), 1, True, False),
}


def write_checkpoint(root: pathlib.Path, name: str, family: str, overrides: dict, fused: bool,
                     mtp: bool = False) -> pathlib.Path:
    """A tiny transformers checkpoint at root/name (the released Qwen3.5 layout when `fused`:
    fused experts, `language_model` prefix; with `mtp`, an MTP head as `mtp.*` keys whose decoder
    layer is a copy of layer 1, full attention)."""
    path = root / name
    save_tiny(family, path, seed=len(name), **overrides)
    cfg = json.loads((path / "config.json").read_text())
    state = _state(path)
    if mtp:
        g = torch.Generator().manual_seed(len(name))
        h = cfg["hidden_size"]
        state.update({"mtp." + k: 0.1 * torch.randn(n, generator=g) for k, n in
                      (("pre_fc_norm_embedding.weight", h), ("pre_fc_norm_hidden.weight", h), ("norm.weight", h))})
        state["mtp.fc.weight"] = 0.08 * torch.randn(h, 2 * h, generator=g)
        layer = "model.layers.1."
        state.update({"mtp.layers.0." + k[len(layer):]: v.clone() for k, v in state.items() if k.startswith(layer)})
        cfg["mtp_num_hidden_layers"] = 1
    if fused:
        state = _official_qwen35_layout(state, cfg["num_experts"])
    if mtp or fused:
        (path / "model.safetensors").unlink()
        _write(path, state, cfg)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: (single-rank logits, [logits of each TP rank])}."""
    root = tmp_path_factory.mktemp("tp")
    g = torch.Generator().manual_seed(PROMPTS_SEED)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    decode = torch.randint(0, 256, (3, 2), generator=g).tolist()
    cases = [dict(name=n, path=str(write_checkpoint(root, n, f, o, fused, mtp)), ep_size=ep)
             for n, (f, o, ep, fused, mtp) in CASES.items()]
    spec = root / "cases.json"
    spec.write_text(json.dumps(dict(cases=cases, prompts=prompts, decode=decode)))
    with Workers("tests/dist/tp_worker.py", spec, root, WORLD) as workers:
        with torch.no_grad():  # the single-rank references, while the workers run
            refs = {c["name"]: tp_script(load_model(c["path"], dtype=torch.float32, device="cpu"), prompts, decode)
                    for c in cases}
        outputs = workers.join(WORKER_TIMEOUT_S)
    assert "TIMEOUT_OK" in outputs[0], outputs[0][-4000:]
    return {n: (refs[n], [load_file(str(root / f"{n}.rank{r}.safetensors"))["logits"] for r in range(WORLD)])
            for n in CASES}


@pytest.mark.mp
@pytest.mark.parametrize("case", list(CASES))
def test_tp_logits_equal_single_rank(runs, case):
    ref, ranks = runs[case]
    mtp = CASES[case][4]
    assert ref.shape == ((2 if mtp else 1) * sum(PROMPT_LENS) + 3 * len(PROMPT_LENS), 256)
    for r, got in enumerate(ranks):
        assert got.shape == ref.shape
        assert rel_err(got, ref) < TOL, f"{case} rank {r}: rel err {rel_err(got, ref):.2e}"
    assert torch.equal(ranks[0], ranks[1]), "the TP ranks' logits differ"
