"""perf.serve's arithmetic that runs without a GPU."""
import json
import pathlib

from nvl72.plan import ModelSpec
from perf.serve import QWEN3_30B_A3B, decode_step_bytes, exposed_by_name, exposed_by_position

# A Qwen3-Next-like config: 8 layers, every 4th full (gated) attention, GDN elsewhere, a shared expert.
NEXT = dict(model_type="qwen3_next", vocab_size=1000, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
            shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
            rms_norm_eps=1e-6, max_position_embeddings=4096)


def test_decode_bound_counts_what_a_step_moves():
    """The bytes of a decode step, written out by hand: bf16 dense weights (projections, router, shared
    expert, lm_head), the touched experts, every sequence's KV and (GDN) its states read and written."""
    e = 3 * 2048 * 768  # one FP8 expert
    attn = 2048 * (32 * 128 + 2 * 4 * 128) + 32 * 128 * 2048  # q, k, v | o
    want = (48 * (attn + 2048 * 128) + 151936 * 2048) * 2 + 48 * 8 * e + 192 * 48 * 2 * 4 * 128 * 2
    got = decode_step_bytes(QWEN3_30B_A3B, 1, 192, e)
    assert got["total"] == want and got["experts_touched"] == 8
    h, e = 256, 3 * 256 * 64
    kd, vd, conv = 2 * 32, 4 * 16, 2 * 2 * 32 + 4 * 16
    gdn = h * (2 * kd + 2 * vd + 2 * 4) + conv * 4 + vd * h  # in_proj qkvz + ba, conv, out_proj
    gated = h * (2 * 4 * 64 + 2 * 2 * 64) + 4 * 64 * h  # q with its gate, k, v | o
    moe = h * 16 + 3 * h * 32  # router, shared expert
    dense = (2 * gated + 6 * gdn + 8 * moe + 1000 * h) * 2
    states = 6 * (conv * 3 * 2 + 4 * 32 * 16 * 4)  # conv tail (bf16), recurrent state (fp32)
    for b in (1, 3):
        touched = 16 * (1 - (1 - 4 / 16) ** b)
        got = decode_step_bytes(NEXT, b, 100, e)["total"]
        assert abs(got - (dense + 8 * touched * e + b * 100 * 2 * 2 * 2 * 64 * 2 + 2 * b * states)) < 1e-3
    # the shared expert held as experts (moe.MoE.num_shared): its weights at the experts' bytes per weight
    fused = decode_step_bytes(NEXT, 1, 100, e, shared_as_experts=True)["total"]
    assert abs(fused - (decode_step_bytes(NEXT, 1, 100, e)["total"] - 8 * 3 * h * 32 * (2 - 1))) < 1e-3


def test_exposed_time_is_the_critical_path_under_overlap():
    # b starts before a ends (PDL: it waits inside its span), c after an idle gap, a twice
    spans = [("a", 0.0, 10.0), ("b", 4.0, 13.0), ("c", 20.0, 25.0), ("a", 24.0, 30.0), ("d", 26.0, 28.0)]
    got = exposed_by_name(list(reversed(spans)))  # order given does not matter: sorted by start
    assert got == {"a": (10.0 + 5.0, 2), "b": (3.0, 1), "c": (5.0, 1), "d": (0.0, 1)}
    assert sum(t for t, _ in got.values()) == 10 + 3 + 5 + 5  # the union of the spans, gaps excluded


def test_exposed_by_position_takes_the_repeating_unit():
    # two units "q a b" (b launched 2 us before a ends), then a shorter one ("q lm": the step's tail) left out
    spans = [("q", 0.0, 1.0), ("a", 1.0, 5.0), ("b", 3.0, 6.0),
             ("q", 6.0, 8.0), ("a", 8.0, 11.0), ("b", 9.0, 14.0), ("q", 14.0, 15.0), ("lm", 15.0, 20.0),
             ("q", 21.0, 22.0)]
    got = exposed_by_position(spans, ("q",))
    assert [op["name"] for op in got] == ["q", "a", "b"] and got[0]["units"] == 2
    assert [op["exposed"] for op in got] == [1.5, 3.5, 2.0]
    assert [op["span"] for op in got] == [1.5, 3.5, 4.0]
    assert [op["lead"] for op in got] == [0.0, 0.0, 2.0]
    assert exposed_by_position(spans, ("none",)) == []
    other_first = [("x" if i == 3 else n, a, b) for i, (n, a, b) in enumerate(spans)]  # either name starts a unit
    assert [op["name"] for op in exposed_by_position(other_first, ("q", "x"))] == ["q", "a", "b"]


def test_the_qwen3_next_shape_config_parses():
    """perf/qwen3_next_shape_24l.json (perf.serve_http --model-config): 6 gated-attention and 18 GDN layers."""
    cfg = json.loads((pathlib.Path(__file__).parents[2] / "perf" / "qwen3_next_shape_24l.json").read_text())
    m = ModelSpec.from_config(cfg, "next")
    assert (m.attn_layers, m.gdn_layers, m.num_experts, m.head_dim) == (6, 18, 512, 256)
    assert decode_step_bytes(cfg, 1, 192, 3 * 2048 * 512)["experts_touched"] == 10
