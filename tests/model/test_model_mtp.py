"""The MTP head loads `mtp.*` (released key names) and equals a direct torch computation of
h = norm(layer(fc(cat[norm_e(embed(next_token)), norm_h(hidden)]))), logits = lm_head(h), with the
layer run by transformers' own decoder layer over the whole sequence; through our paged KV
(the MTP layer's own cache index) in one prefill, in chunks and token by token."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvl72.config import ModelConfig
from nvl72.model.batch import ForwardBatch
from nvl72.model.loader import load_model
from tests.model.tiny import CONFIGS, PAGE_SIZE, PagedRunner, hf_config, rel_err, save_tiny

L = 23  # main-model tokens; MTP predicts at positions 0..L-2
TOL = 1e-4


def _zc_norm(x, w, eps=1e-6):
    """Zero-centred RMSNorm, written out."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def mtp_ckpt(request, tmp_path_factory):
    """A tiny hybrid checkpoint plus `mtp.*` tensors named as in the released checkpoints; the
    MTP decoder layer's weights are those of a fresh HF full-attention layer (randomised)."""
    family = request.param
    path = tmp_path_factory.mktemp(f"mtp_{family}")
    ref = save_tiny(family, path, seed=21)
    _, model_cls, _ = CONFIGS[family]
    donor = model_cls(hf_config(family)).float().eval()
    g = torch.Generator().manual_seed(22)
    layer = donor.model.layers[1]  # a full-attention MoE layer
    with torch.no_grad():
        for name, p in layer.named_parameters():  # zero-centred norms around 0, matrices small
            p.copy_((0.1 if "norm" in name else 0.08) * torch.randn(p.shape, generator=g))
    h = ref.config.hidden_size
    mtp = {
        "mtp.fc.weight": 0.08 * torch.randn(h, 2 * h, generator=g),
        "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(h, generator=g),
        "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(h, generator=g),
        "mtp.norm.weight": 0.1 * torch.randn(h, generator=g),
    }
    # transformers' save layout of that layer, per-expert keys (as Qwen3-Next ships them)
    donor.save_pretrained(path / "donor")
    for k, v in load_file(str(path / "donor" / "model.safetensors")).items():
        if k.startswith("model.layers.1."):
            mtp["mtp.layers.0." + k[len("model.layers.1.") :]] = v
    save_file(mtp, str(path / "mtp.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_model(path, dtype=torch.float32, device="cpu")
    tokens = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(5)).tolist()
    return model, tokens, _direct(ref, layer, mtp, tokens), mtp, path


@torch.no_grad()
def _direct(ref, layer, mtp, tokens):
    """MTP logits [L-1, V] straight from the formula with transformers' decoder layer."""
    hidden = ref.model(torch.tensor([tokens])).last_hidden_state[0]  # [L, H] after the final norm
    emb = ref.model.embed_tokens(torch.tensor(tokens[1:]))  # [L-1, H]
    x = torch.cat([_zc_norm(emb, mtp["mtp.pre_fc_norm_embedding.weight"]),
                   _zc_norm(hidden[:-1], mtp["mtp.pre_fc_norm_hidden.weight"])], dim=-1)
    x = (x @ mtp["mtp.fc.weight"].t())[None]  # [1, L-1, H]
    pos = torch.arange(len(tokens) - 1)[None]
    cos_sin = ref.model.rotary_emb(x, pos if ref.config.model_type == "qwen3_next" else pos[None].expand(3, 1, -1))
    n = len(tokens) - 1
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    x = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
    x = _zc_norm(x[0], mtp["mtp.norm.weight"])
    return ref.lm_head(x)


def _mtp_batch(run: PagedRunner, sid: int, next_tokens: list[int], start: int) -> ForwardBatch:
    """MTP step over positions start.. of a sequence whose main-model KV is already in its pages."""
    n = start + len(next_tokens)
    pages = run.pages[sid]
    assert len(pages) * PAGE_SIZE >= n
    return ForwardBatch(
        input_ids=torch.tensor(next_tokens),
        positions=torch.arange(start, n),
        query_start_loc=torch.tensor([0, len(next_tokens)], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        page_table=torch.tensor([pages], dtype=torch.int32),
    )


def test_mtp_weights_load(mtp_ckpt):
    model, _, _, mtp, _ = mtp_ckpt
    assert model.mtp is not None
    params = dict(model.named_parameters())
    assert torch.equal(params["mtp.fc.weight"], mtp["mtp.fc.weight"])
    assert torch.equal(params["mtp.layers.0.self_attn.q_proj.weight"], mtp["mtp.layers.0.self_attn.q_proj.weight"])
    spec = model.cache_spec()
    n = model.config.num_hidden_layers
    assert spec.num_layers == n + 1 and n in spec.kv  # the MTP layer's own KV


@pytest.mark.parametrize("chunks", [[L - 1], [9, L - 10], [1] * (L - 1)], ids=["prefill", "two_chunks", "token_by_token"])
def test_mtp_equals_direct_formula(mtp_ckpt, chunks):
    model, tokens, want, _, _ = mtp_ckpt
    run = PagedRunner(model, seed=9)
    with torch.no_grad():
        batch = run.batch([(0, tokens)])
        hidden = model(batch, run.caches)  # [L, H]
        got, start = [], 0
        for c in chunks:
            b = _mtp_batch(run, 0, tokens[start + 1 : start + 1 + c], start)
            got.append(model.compute_logits(model.forward_mtp(b, run.caches, hidden[start : start + c])))
            start += c
    got = torch.cat(got)
    assert got.shape == want.shape
    assert rel_err(got, want) < TOL


def test_mtp_disabled_skips_mtp_keys(mtp_ckpt):
    model, _, _, _, path = mtp_ckpt
    plain = load_model(path, dtype=torch.float32, device="cpu", enable_mtp=False)
    assert plain.mtp is None and plain.cache_spec().num_layers == model.config.num_hidden_layers
    with pytest.raises(ValueError, match="without its MTP head"):
        plain.forward_mtp(None, None, torch.zeros(1, 64))


def test_mtp_layers_found_in_checkpoint_when_config_is_silent(mtp_ckpt, tmp_path):
    """Qwen3-Next's config.json names no MTP layers although its checkpoint ships `mtp.*`."""
    model, _, _, mtp, path = mtp_ckpt
    cfg = json.loads((path / "config.json").read_text())
    del cfg["mtp_num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for f in ("model.safetensors", "mtp.safetensors"):
        (tmp_path / f).symlink_to(path / f)
    assert ModelConfig.from_pretrained(tmp_path).mtp_num_hidden_layers == 1
    found = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert found.config.mtp_num_hidden_layers == 1 and found.mtp is not None
    assert torch.equal(dict(found.named_parameters())["mtp.fc.weight"], mtp["mtp.fc.weight"])
