"""Checkpoint layouts (per-expert / fused experts, sharded, multimodal prefixes, tied head), load
errors that name the key, dummy weights, and expert-parallel slicing by the weight loaders."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from nvl72.config import ModelConfig
from nvl72.model.loader import load_model
from nvl72.model.weights import WeightLoadError
from tests.model.tiny import CONFIGS, PagedRunner, hf_config, hf_logits, rel_err, save_tiny

PROMPT = [5, 17, 200, 3, 99, 42, 7, 1, 250, 31, 64]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """A per-expert qwen3_5_moe checkpoint written by transformers, and its reference model."""
    path = tmp_path_factory.mktemp("q35")
    ref = save_tiny("qwen3_5_moe", path, seed=11)
    return path, ref


def _state(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _write(path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 1) -> None:
    """Write `tensors` as `shards` safetensors files (+ index when sharded) and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    keys = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in keys}, str(path / "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[s::shards]
        save_file({k: tensors[k].contiguous() for k in part}, str(path / name))
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _official_qwen35_layout(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert HF keys -> the released Qwen3.5 layout: `model.language_model.` prefix, fused
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, I]."""
    out, layers = {}, set()
    for k, v in state.items():
        if ".mlp.experts." in k:
            layers.add(k.split(".mlp.experts.")[0])
            continue
        out[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
    for pre in layers:
        e = range(num_experts)
        gate = [state[f"{pre}.mlp.experts.{i}.gate_proj.weight"] for i in e]
        up = [state[f"{pre}.mlp.experts.{i}.up_proj.weight"] for i in e]
        new = pre.replace("model.", "model.language_model.", 1)
        out[f"{new}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[f"{new}.mlp.experts.down_proj"] = torch.stack([state[f"{pre}.mlp.experts.{i}.down_proj.weight"] for i in e])
    out["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(12, 4)  # skipped vision tower
    return out


def _logits(model, prompt=PROMPT) -> torch.Tensor:
    return PagedRunner(model, seed=1).step([(0, prompt)])[0]


def test_fused_expert_checkpoint_equals_per_expert_twin(qwen35, tmp_path):
    path, ref = qwen35
    cfg = json.loads((path / "config.json").read_text())
    mm = transformers.Qwen3_5MoeConfig(text_config=cfg).to_dict()  # the nested multimodal config.json
    official = _official_qwen35_layout(_state(path), cfg["num_experts"])
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in official)
    _write(tmp_path / "fused", official, mm, shards=3)
    fused = load_model(tmp_path / "fused", dtype=torch.float32, device="cpu")
    twin = load_model(path, dtype=torch.float32, device="cpu")
    a, b = _logits(fused), _logits(twin)
    assert torch.equal(a, b)
    assert rel_err(a, hf_logits(ref, PROMPT)) < 1e-4


def test_tied_embeddings_and_unnormalised_topk_match_transformers(tmp_path):
    """Tied lm_head (no `lm_head.weight` in the checkpoint) and Qwen3-MoE's norm_topk_prob=False."""
    ref = save_tiny("qwen3_moe", tmp_path, seed=4, tie_word_embeddings=True, norm_topk_prob=False)
    assert "lm_head.weight" not in _state(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert model.lm_head is None and not model.model.layers[0].mlp.norm_topk_prob
    assert rel_err(_logits(model), hf_logits(ref, PROMPT)) < 1e-4


def _broken(qwen35, tmp_path, edit) -> str:
    path, _ = qwen35
    state = _state(path)
    edit(state)
    _write(tmp_path / "broken", state, json.loads((path / "config.json").read_text()))
    with pytest.raises(WeightLoadError) as e:
        load_model(tmp_path / "broken", dtype=torch.float32, device="cpu")
    return str(e.value)


def test_missing_expert_key_is_named(qwen35, tmp_path):
    key = "model.layers.2.mlp.experts.5.up_proj.weight"
    msg = _broken(qwen35, tmp_path, lambda s: s.pop(key))
    assert key in msg and "missing" in msg


def test_missing_plain_key_is_named(qwen35, tmp_path):
    key = "model.layers.0.linear_attn.A_log"
    msg = _broken(qwen35, tmp_path, lambda s: s.pop(key))
    assert key in msg


def test_wrong_shape_names_key_and_both_shapes(qwen35, tmp_path):
    key = "model.layers.1.self_attn.k_proj.weight"

    def edit(s):
        s[key] = torch.zeros(48, 64)

    msg = _broken(qwen35, tmp_path, edit)
    assert key in msg and "(48, 64)" in msg and "(64, 64)" in msg


def test_wrong_fused_expert_shape_is_named(qwen35, tmp_path):
    path, _ = qwen35
    cfg = json.loads((path / "config.json").read_text())
    state = _official_qwen35_layout(_state(path), cfg["num_experts"])
    key = "model.language_model.layers.3.mlp.experts.down_proj"
    state[key] = state[key][:6]  # 6 of 8 experts
    _write(tmp_path / "bad", state, cfg)
    with pytest.raises(WeightLoadError, match=f"{key}.*\\(6, 64, 32\\).*\\(8, 64, 32\\)"):
        load_model(tmp_path / "bad", dtype=torch.float32, device="cpu")


def test_unexpected_key_is_named(qwen35, tmp_path):
    key = "model.layers.0.self_attn.rogue.weight"
    msg = _broken(qwen35, tmp_path, lambda s: s.__setitem__(key, torch.zeros(2)))
    assert key in msg and "unexpected" in msg


def test_missing_shard_file_is_named(qwen35, tmp_path):
    path, _ = qwen35
    _write(tmp_path / "sh", _state(path), json.loads((path / "config.json").read_text()), shards=2)
    (tmp_path / "sh" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="model-00002-of-00002.safetensors"):
        load_model(tmp_path / "sh", dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_dummy_weights_give_finite_seeded_logits(family):
    cfg = ModelConfig.from_dict({**hf_config(family).to_dict(), "mtp_num_hidden_layers": int(family != "qwen3_moe")})
    a = load_model(None, config=cfg, dtype=torch.float32, device="cpu", load_format="dummy", seed=3)
    b = load_model(None, config=cfg, dtype=torch.float32, device="cpu", load_format="dummy", seed=3)
    la = _logits(a)
    assert torch.isfinite(la).all() and la.std() > 1e-3 and la.abs().max() < 50
    assert torch.equal(la, _logits(b))
    if cfg.has_mtp:
        assert a.mtp is not None and all(torch.isfinite(p).all() for p in a.mtp.parameters())


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_expert_parallel_loaders_slice_experts(qwen35, tmp_path, layout):
    """Two EP ranks each load half the experts (from per-expert keys, or rows of the fused
    tensors); their MoE outputs sum to the full layer's."""
    path, _ = qwen35
    full = load_model(path, dtype=torch.float32, device="cpu")
    if layout == "fused":
        cfg = json.loads((path / "config.json").read_text())
        _write(tmp_path / "fused", _official_qwen35_layout(_state(path), cfg["num_experts"]), cfg)
        path = tmp_path / "fused"
    ranks = [load_model(path, dtype=torch.float32, device="cpu", ep_rank=r, ep_size=2) for r in (0, 1)]
    mlp_full = full.model.layers[1].mlp
    for r, m in enumerate(ranks):
        w13 = m.model.layers[1].mlp.w13
        assert w13.shape[0] == 4 and torch.equal(w13, mlp_full.w13[4 * r : 4 * r + 4])
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    parts = sum(m.model.layers[1].mlp(x) for m in ranks)
    assert rel_err(parts, mlp_full(x)) < 1e-5


def test_dummy_bf16_tracks_fp32():
    """The bf16 path (RoPE tables, norms, attention, GDN) stays close to the fp32 one on the same weights."""
    cfg = ModelConfig.from_dict(hf_config("qwen3_next").to_dict())
    f32 = load_model(None, config=cfg, dtype=torch.float32, device="cpu", load_format="dummy", seed=5)
    b16 = load_model(None, config=cfg, dtype=torch.bfloat16, device="cpu", load_format="dummy", seed=5)
    a, b = _logits(f32), _logits(b16)
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert rel_err(b, a) < 5e-2


def test_prepare_experts_frees_converted_masters(monkeypatch):
    """prepare_experts (what build_engine runs after loading): with FP8 experts the loaded bf16 /
    fp32 copies are freed and the logits stay those of the converted model; with the reference
    backend nothing is freed."""
    from nvl72.model.loader import prepare_experts

    cfg = ModelConfig.from_dict({**hf_config("qwen3_moe").to_dict(), "hidden_size": 128, "moe_intermediate_size": 128,
                                 "head_dim": 32})
    ref = load_model(None, config=cfg, dtype=torch.float32, device="cpu", load_format="dummy", seed=4)
    assert prepare_experts(ref) == 0
    monkeypatch.setenv("NVL72_MOE_BACKEND", "mxfp8-emulated")
    model = load_model(None, config=cfg, dtype=torch.float32, device="cpu", load_format="dummy", seed=4)
    want = _logits(model)  # converts on first use, keeps the loaded weights
    from moe import MoE

    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    size = sum(m.w13.numel() * 4 + m.w2.numel() * 4 for m in moes)
    assert prepare_experts(model) == size > 0
    assert moes and all(m.masters_released and m.w13.numel() == 0 for m in moes)
    assert torch.equal(_logits(model), want)
