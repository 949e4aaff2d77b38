"""Tensor-parallel cutting of the model, in one process (no collectives run): what each rank's
loaders read from a checkpoint, which slices they keep, the per-rank cache spec, errors that name
the bad value, and dummy weights that agree on the parameters the ranks replicate."""
import json

import pytest
import torch

from nvl72.config import ModelConfig
from nvl72.model import weights
from nvl72.model.loader import load_model
from nvl72.model.parallel_layout import LayoutError, ParallelLayout
from nvl72.model.qwen import build_model
from nvl72.model.weights import WeightLoadError
from tests.model.test_model_loader import _official_qwen35_layout, _state, _write
from tests.model.tiny import hf_config, save_tiny


def _no_reduce(x):
    raise AssertionError("no collective runs in these tests")


def _layout(rank: int, ep_size: int = 1, tp_size: int = 2) -> ParallelLayout:
    return ParallelLayout(rank, tp_size, rank // (tp_size // ep_size), ep_size, _no_reduce)


def _load(path, rank: int, ep_size: int = 1):
    return load_model(path, dtype=torch.float32, device="cpu", parallel=_layout(rank, ep_size))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{name: path}: qwen3_next (interleaved in_proj_qkvz/ba, per-expert keys) with one KV head,
    qwen3_5_moe in the released fused-expert layout with two."""
    root = tmp_path_factory.mktemp("tp_layout")
    save_tiny("qwen3_next", root / "next", seed=3, num_key_value_heads=1)
    save_tiny("qwen3_5_moe", root / "q35", seed=4)
    cfg = json.loads((root / "q35/config.json").read_text())
    _write(root / "q35_fused", _official_qwen35_layout(_state(root / "q35"), cfg["num_experts"]), cfg)
    return {"next": root / "next", "q35_fused": root / "q35_fused"}


@pytest.mark.parametrize("name,ep_size", [("next", 1), ("next", 2), ("q35_fused", 1), ("q35_fused", 2)])
def test_rank_reads_exactly_what_it_keeps(ckpts, monkeypatch, name, ep_size):
    """Lazy checkpoint tensors: a TP rank reads as many elements as its parameters hold (its
    slices only), half-ish of what the single-rank model reads."""
    read = []
    get = weights.LazyTensor.__getitem__

    def counted(self, idx):
        t = get(self, idx)
        read.append(t.numel())
        return t

    monkeypatch.setattr(weights.LazyTensor, "__getitem__", counted)
    full = load_model(ckpts[name], dtype=torch.float32, device="cpu")
    full_read, read[:] = sum(read), []
    for rank in range(2):
        model = _load(ckpts[name], rank, ep_size)
        held = sum(p.numel() for p in model.parameters())
        assert sum(read) == held, f"rank {rank} read {sum(read)} elements, holds {held}"
        assert held < 0.75 * full_read
        read.clear()
    assert full_read == sum(p.numel() for p in full.parameters())


def test_slices_kept_by_each_rank(ckpts):
    """qwen3_next, one KV head, TP=2: q heads split, the KV head on both ranks, the interleaved
    qkvz rows one key-head group per rank, conv channels as q | k | v segments, experts split by
    intermediate (EP=1) with gate and up rows from both halves of the fused w13."""
    full = load_model(ckpts["next"], dtype=torch.float32, device="cpu")
    cfg = full.config
    d, kd, vd = cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    for r in range(2):
        m = _load(ckpts["next"], r)
        att, fatt = m.model.layers[1].self_attn, full.model.layers[1].self_attn
        assert (att.num_heads, att.num_kv_heads) == (2, 1)
        q_rows = 2 * d * 2  # two gated heads per rank
        assert torch.equal(att.q_proj.weight, fatt.q_proj.weight[r * q_rows : (r + 1) * q_rows])
        assert torch.equal(att.k_proj.weight, fatt.k_proj.weight) and torch.equal(att.v_proj.weight, fatt.v_proj.weight)
        assert torch.equal(att.o_proj.weight, fatt.o_proj.weight[:, r * 2 * d : (r + 1) * 2 * d])
        gdn, fgdn = m.model.layers[0].linear_attn, full.model.layers[0].linear_attn
        rows = fgdn.in_proj_qkvz.weight.shape[0] // 2
        assert torch.equal(gdn.in_proj_qkvz.weight, fgdn.in_proj_qkvz.weight[r * rows : (r + 1) * rows])
        w = fgdn.conv1d.weight
        segs = [w[r * kd : (r + 1) * kd], w[2 * kd + r * kd : 2 * kd + (r + 1) * kd],
                w[4 * kd + r * vd // 2 : 4 * kd + (r + 1) * vd // 2]]
        assert torch.equal(gdn.conv1d.weight, torch.cat(segs))
        assert torch.equal(gdn.A_log, fgdn.A_log[r * 2 : (r + 1) * 2])
        moe, fmoe = m.model.layers[1].mlp, full.model.layers[1].mlp
        i = cfg.moe_intermediate_size // 2
        assert torch.equal(moe.w13[:, :i], fmoe.w13[:, r * i : (r + 1) * i])
        assert torch.equal(moe.w13[:, i:], fmoe.w13[:, cfg.moe_intermediate_size + r * i :][:, :i])
        assert torch.equal(moe.w2, fmoe.w2[:, :, r * i : (r + 1) * i])
        assert torch.equal(moe.gate.weight, fmoe.gate.weight)


def test_cache_spec_holds_the_rank_heads():
    cfg = ModelConfig.from_dict(hf_config("qwen3_5_moe", num_key_value_heads=2).to_dict())
    one = build_model(cfg, torch.float32, "meta").cache_spec()
    two = build_model(cfg, torch.float32, "meta", parallel=_layout(1)).cache_spec()
    assert set(two.kv) == set(one.kv) and set(two.state) == set(one.state)
    assert two.kv[1].num_kv_heads == 1 and one.kv[1].num_kv_heads == 2
    assert two.kv_bytes_per_page(4) * 2 == one.kv_bytes_per_page(4)
    assert two.state[0].recurrent_shape == (2, 16, 16) and one.state[0].recurrent_shape == (4, 16, 16)
    assert two.state[0].conv_shape == (64, 3) and one.state[0].conv_shape == (128, 3)
    cfg1 = ModelConfig.from_dict(hf_config("qwen3_moe", num_key_value_heads=1).to_dict())
    assert build_model(cfg1, torch.float32, "meta", parallel=_layout(1)).cache_spec().kv[0].num_kv_heads == 1


def _broken(ckpts, tmp_path, edit, rank=1, ep_size=1) -> str:
    path = ckpts["q35_fused"]
    state = _state(path)
    edit(state)
    _write(tmp_path / "broken", state, json.loads((path / "config.json").read_text()))
    with pytest.raises(WeightLoadError) as e:
        _load(tmp_path / "broken", rank, ep_size)
    return str(e.value)


@pytest.mark.parametrize("key", ["model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
                                 "model.language_model.layers.1.self_attn.o_proj.weight",
                                 "model.language_model.layers.2.mlp.shared_expert.down_proj.weight"])
def test_missing_sharded_key_is_named(ckpts, tmp_path, key):
    msg = _broken(ckpts, tmp_path, lambda s: s.pop(key))
    assert "missing" in msg and key.replace("language_model.", "") in msg


def test_wrong_shape_names_key_and_full_shape(ckpts, tmp_path):
    key = "model.language_model.layers.1.self_attn.k_proj.weight"

    def edit(s):
        s[key] = torch.zeros(48, 64)

    msg = _broken(ckpts, tmp_path, edit)
    assert key in msg and "(48, 64)" in msg and "(64, 64)" in msg


def test_wrong_fused_expert_shape_is_named_under_tp(ckpts, tmp_path):
    key = "model.language_model.layers.3.mlp.experts.gate_up_proj"

    def edit(s):
        s[key] = s[key][:, :48]

    msg = _broken(ckpts, tmp_path, edit, rank=0, ep_size=2)
    assert key in msg and "(8, 48, 64)" in msg and "(8, 64, 64)" in msg


def test_bad_layouts_name_the_value():
    with pytest.raises(LayoutError, match="tp_rank=2"):
        ParallelLayout(2, 2, 0, 1, _no_reduce)
    with pytest.raises(LayoutError, match="tp_size=2 needs an all_reduce"):
        ParallelLayout(0, 2)
    with pytest.raises(LayoutError, match="ep_size=3"):
        ParallelLayout(0, 2, 0, 3, _no_reduce)
    with pytest.raises(LayoutError, match="ep_rank=0"):
        ParallelLayout(1, 2, 0, 2, _no_reduce)
    q35 = ModelConfig.from_dict(hf_config("qwen3_5_moe").to_dict())
    moe = ModelConfig.from_dict(hf_config("qwen3_moe").to_dict())
    with pytest.raises(LayoutError, match="num_attention_heads=4 is not divisible by 3"):
        build_model(moe, torch.float32, "meta", parallel=ParallelLayout(0, 3, 0, 1, _no_reduce))
    with pytest.raises(LayoutError, match="linear_num_key_heads=2 is not divisible by 4"):
        build_model(q35, torch.float32, "meta", parallel=ParallelLayout(0, 4, 0, 1, _no_reduce))
    kv3 = ModelConfig.from_dict(hf_config("qwen3_moe", num_attention_heads=6, num_key_value_heads=3).to_dict())
    with pytest.raises(LayoutError, match="num_key_value_heads=3"):
        build_model(kv3, torch.float32, "meta", parallel=ParallelLayout(0, 2, 0, 1, _no_reduce))
    with pytest.raises(LayoutError, match="ep_size=2"):
        build_model(q35, torch.float32, "meta", ep_rank=1, ep_size=2, parallel=_layout(0))


@pytest.mark.parametrize("tp_size,ep_size", [(2, 2), (2, 1), (4, 2)])
def test_dummy_weights_are_one_model_in_every_layout(tmp_path, tp_size, ep_size):
    """Each TP / EP rank's dummy weights are its slices of the single-rank model's: the single
    model saved as a checkpoint and loaded by the rank gives the same parameters."""
    hf = {**hf_config("qwen3_next").to_dict(), "mtp_num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "linear_num_key_heads": 4, "linear_num_value_heads": 4}
    cfg = ModelConfig.from_dict(hf)
    single = load_model(None, config=cfg, dtype=torch.float32, device="cpu", load_format="dummy", seed=5)
    fused = {".w13": ".experts.gate_up_proj", ".w2": ".experts.down_proj"}
    _write(tmp_path / "ck", {next((n[: -len(k)] + v for k, v in fused.items() if n.endswith(k)), n): p.detach()
                             for n, p in single.named_parameters()}, hf)
    for r in range(tp_size):
        layout = ParallelLayout(r, tp_size, r // (tp_size // ep_size), ep_size, _no_reduce)
        dummy = load_model(None, config=cfg, dtype=torch.float32, device="cpu", load_format="dummy", seed=5,
                           parallel=layout)
        ck = dict(load_model(tmp_path / "ck", dtype=torch.float32, device="cpu", parallel=layout).named_parameters())
        for name, p in dummy.named_parameters():
            assert torch.equal(p, ck[name]), (r, name)


def test_dummy_weights_agree_where_ranks_replicate():
    cfg = ModelConfig.from_dict({**hf_config("qwen3_next").to_dict(), "mtp_num_hidden_layers": 1})
    ranks = [load_model(None, config=cfg, dtype=torch.float32, device="cpu", load_format="dummy", seed=2,
                        parallel=_layout(r, ep_size=2)) for r in range(2)]
    p0, p1 = (dict(m.named_parameters()) for m in ranks)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight", "mtp.fc.weight"):
        assert torch.equal(p0[name], p1[name]), name
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.w13"):  # the ranks' slices
        assert p0[name].shape == p1[name].shape and not torch.equal(p0[name], p1[name]), name
