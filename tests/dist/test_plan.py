"""`nvl72 plan`: built-in model figures, the cost model's sizing and its sourced constants, placement
of prefill (one node) and decode (four nodes of one NVLink domain) instances, the printed report."""
import json
import math
import pathlib

import pytest
from transformers import Qwen3_5MoeConfig, Qwen3NextConfig

from nvl72.cli import main
from nvl72.plan import MODELS, ModelSpec, Plan, PlanError, Workload, load_model, make_plan
from nvl72.topology import RACKS, load_rack


@pytest.mark.parametrize("name", list(MODELS))
def test_builtin_figures_add_up_to_the_stated_sizes(name):
    m = MODELS[name]
    assert m.total_params / 1e9 == pytest.approx(m.stated_total_b, rel=0.02)
    # Active counts on model cards round and sometimes leave out embeddings: within 30%.
    assert m.active_params / 1e9 == pytest.approx(m.stated_active_b, rel=0.3)


def test_builtin_qwen3_next_matches_the_transformers_config():
    got = ModelSpec.from_config(Qwen3NextConfig().to_dict(), "x")
    want = MODELS["Qwen3-Next-80B-A3B"]
    for f in ("num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "num_key_value_heads", "head_dim", "linear_num_value_heads", "full_attention_interval"):
        assert getattr(got, f) == getattr(want, f), f


def test_model_from_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(Qwen3_5MoeConfig().to_dict()))
    m = load_model(str(tmp_path))
    assert (m.model_type, m.attn_layers, m.gdn_layers) == ("qwen3_5_moe", 10, 30)
    cfg = Qwen3_5MoeConfig().to_dict()
    del cfg["text_config"]["num_experts"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PlanError, match="num_experts"):
        load_model(str(tmp_path))
    with pytest.raises(PlanError, match="'Qwen9-1T'"):
        load_model("Qwen9-1T")


def _check_layout(plan: Plan):
    rack = plan.rack
    seen = set()
    for inst in plan.instances:
        assert not seen.intersection(inst.ranks)
        seen.update(inst.ranks)
        nodes = {rack.node_of_rank(r) for r in inst.ranks}
        if inst.role == "prefill":
            assert len(inst.ranks) == 4 and len(nodes) == 1 and inst.tp == inst.ep == 4
        else:
            assert len(inst.ranks) == 16 and len(nodes) == 4 and inst.ep == 16 and inst.dp == 16
            assert all(set(rack.node_ranks(n)) <= set(inst.ranks) for n in nodes)  # whole nodes
            assert len({rack.nodes[n].domain for n in nodes}) == 1


@pytest.mark.parametrize("model", ["Qwen3-235B-A22B", "Qwen3.5-397B-A17B"])
def test_plan_nvl72_prints_layout_and_reasoning(model, capsys):
    rc = main(["plan", "--rack", "nvl72", "--model", model, "--input-tps", "300000", "--output-tps", "100000",
               "--decode-batch-threshold", "128"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("rack nvl72: 18 nodes x 4 GB200 = 72 ranks", "capacity per instance", "step at batch",
                 "needed:", "estimated, not measured", "front       : node00 host CPU", "prefill[0]",
                 "decode[0]", "[TP4/EP4]", "[DP16 attention + EP16]"):
        assert text in out, text
    plan = make_plan(RACKS["nvl72"], MODELS[model], Workload(300000, 100000))
    _check_layout(plan)
    # The printed counts are the cost model's: the "needed" lines agree with the layout.
    n_p, n_d = len(plan.of_role("prefill")), len(plan.of_role("decode"))
    assert f"= {n_p} instance(s)" in out and f"-> {n_d} instance(s) of 16" in out
    assert n_p >= 1 and n_d >= 1


def test_sizing_follows_the_rates_and_the_threshold():
    rack, m = RACKS["nvl72"], MODELS["Qwen3-235B-A22B"]

    def counts(**kw):
        p = make_plan(rack, m, Workload(**{"input_tps": 100000, "output_tps": 20000, **kw}))
        return len(p.of_role("prefill")), len(p.of_role("decode"))

    base_p, base_d = counts()
    assert counts(input_tps=200000)[0] > base_p
    assert counts(output_tps=120000)[1] > base_d
    assert counts(output_tps=120000, decode_batch_threshold=16)[1] > counts(output_tps=120000)[1]
    assert counts(input_tps=0, output_tps=0) == (0, 0)


def test_decode_rank_count_is_rate_times_step_over_batch():
    rack, m = RACKS["nvl72"], MODELS["Qwen3.5-397B-A17B"]
    plan = make_plan(rack, m, Workload(0, 150000, decode_batch_threshold=64))
    line = next(s for s in plan.explanation if "step at batch 64:" in s)
    step_ms = float(line.split("= ")[-1].split(" ms")[0])
    ranks = math.ceil(150000 * step_ms / 1e3 / 64)
    assert len(plan.of_role("decode")) == math.ceil(ranks / 16)


def test_over_capacity_is_reported():
    plan = make_plan(RACKS["nvl72"], MODELS["Qwen3-30B-A3B"], Workload(5e7, 5e6))
    assert any("OVER CAPACITY" in s for s in plan.explanation)
    _check_layout(plan)
    assert sum(len(i.ranks) for i in plan.instances) <= 72


def test_decode_instances_stay_in_one_nvlink_domain(tmp_path):
    f = tmp_path / "two.yaml"
    nodes = "\n".join(f"  - {{name: n{i}, domain: {'a' if i < 6 else 'b'}}}" for i in range(12))
    f.write_text(f"gpu: GB200\ngpus_per_node: 4\nnodes:\n{nodes}\n")
    plan = make_plan(load_rack(str(f)), MODELS["Qwen3-235B-A22B"], Workload(1000, 1000), prefill_instances=4,
                     decode_instances=2)
    _check_layout(plan)
    # Each 24-rank domain holds one decode instance at its end; its first two nodes go to prefill.
    assert [i.ranks[0] for i in plan.of_role("decode")] == [8, 32]
    with pytest.raises(PlanError, match="cannot hold"):
        make_plan(load_rack(str(f)), MODELS["Qwen3-235B-A22B"], Workload(0, 0), prefill_instances=0,
                  decode_instances=1, decode_size=32)


def test_two_racks_example_file():
    root = pathlib.Path(__file__).resolve().parents[2]
    rack = load_rack(str(root / "launch" / "racks" / "two-nvl72.yaml"))
    assert rack.world_size == 144 and sorted(rack.domains()) == ["nvl72-rack0", "nvl72-rack1"]
    plan = make_plan(rack, MODELS["Qwen3.5-397B-A17B"], Workload(600000, 400000))
    _check_layout(plan)
    assert {rack.nodes[rack.node_of_rank(i.ranks[0])].domain for i in plan.of_role("decode")} == set(rack.domains())


def test_measured_constants_are_labelled(tmp_path):
    from nvl72.plan import CONSTANTS_PATH

    data = json.loads(CONSTANTS_PATH.read_text())
    data["hardware"]["GB200"]["hbm_tbps"].update(value=7.2, measured=True, source="perf/ run", date="2026-11-21")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    plan = make_plan(RACKS["nvl72"], MODELS["Qwen3-30B-A3B"], Workload(1000, 1000), constants_path=path)
    line = next(s for s in plan.explanation if "hbm_tbps[GB200]" in s)
    assert "7.2 TB/s (measured 2026-11-21; perf/ run)" in line
    assert any("prefill_mfu" in s and "estimated, not measured" in s for s in plan.explanation)


def test_plan_json_round_trip_and_validation(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "--model", "Qwen3-235B-A22B", "--input-tps", "1e5", "--output-tps", "1e4",
                 "--out", str(out)]) == 0
    plan = Plan.from_json(out.read_text())
    assert plan.rack.world_size == 72 and plan.instances and plan.model == "Qwen3-235B-A22B"
    d = json.loads(out.read_text())
    d["instances"][1]["ranks"] = d["instances"][0]["ranks"]
    with pytest.raises(PlanError, match="rank 0 is in both prefill\\[0\\] and"):
        Plan.from_json(json.dumps(d))
    with pytest.raises(PlanError, match="not a plan"):
        Plan.from_json("{}")


@pytest.mark.parametrize("args,match", [
    (["--model", "Qwen3-235B-A22B", "--decode-size", "12"], "decode EP=12 does not divide"),
    (["--model", "Qwen3-235B-A22B", "--prefill-tp", "3"], "prefill EP=3 does not divide"),
    (["--model", "Qwen3-235B-A22B", "--decode-batch-threshold", "0"], "threshold must be positive, got 0"),
    (["--model", "Qwen3-235B-A22B", "--rack", "cpu:4"], "CPU rack needs --prefill-instances"),
    (["--model", "Qwen3-235B-A22B", "--rack", "hgx-h100", "--decode-size", "4"], "does not fit a decode rank of EP4"),
    (["--model", "Qwen3.5-397B-A17B", "--rack", "hgx-h100"], "does not fit a prefill rank of TP4"),
    ([], "--model is required"),
])
def test_plan_errors_name_the_value(args, match, capsys):
    assert main(["plan", *args]) == 2
    assert match in capsys.readouterr().err
