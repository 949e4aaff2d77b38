"""The attention-path references (nvl72.model.ops) against transformers' functions and a dense
causal attention, on fresh random inputs."""
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from nvl72.config import ModelConfig
from nvl72.model import ops
from nvl72.model.batch import ForwardBatch
from nvl72.model.layers import rope_inv_freq


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_both_conventions_equal_transformers(dtype):
    x, w = _rand(5, 3, 48, seed=1, dtype=dtype), _rand(48, seed=2, dtype=dtype) * 0.1
    std = hf_moe.Qwen3MoeRMSNorm(48, eps=1e-6).to(dtype)
    zc = hf_next.Qwen3NextRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        std.weight.copy_(1 + w)
        zc.weight.copy_(w)
        assert torch.equal(ops.rms_norm(x, std.weight, 1e-6, zero_centered=False), std(x))
        assert torch.equal(ops.rms_norm(x, zc.weight, 1e-6, zero_centered=True), zc(x))


@pytest.mark.parametrize("head_dim, rotary_dim", [(32, 32), (32, 8), (64, 16)])
def test_rope_full_and_partial_equal_transformers(head_dim, rotary_dim):
    t, heads = 11, 3
    q, k = _rand(t, heads, head_dim, seed=3), _rand(t, heads, head_dim, seed=4)
    pos = torch.tensor([0, 1, 2, 7, 8, 100, 3, 4, 5, 6, 511])
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    cos, sin = ops.rope_cos_sin(pos, inv_freq, torch.float32)
    # transformers: [B, heads, T, D] with cos/sin [B, T, R]
    hq, hk = hf_next.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.allclose(ops.apply_rope(q, cos, sin), hq[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(ops.apply_rope(k, cos, sin), hk[0].transpose(0, 1), atol=1e-6)
    assert torch.equal(ops.apply_rope(q, cos, sin)[..., rotary_dim:], q[..., rotary_dim:])


def _paged_setup(ctx_lens, q_lens, page_size, hkv, d, seed):
    """Random K/V for every context written through `write_kv` into shuffled pages, in two
    steps (the cached prefix, then this step's new tokens, as the model does)."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + page_size - 1) // page_size for n in ctx_lens]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    width = max(need)
    page_table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    kv_cache = torch.randn(num_pages, 2, hkv, page_size, d, generator=g)  # garbage in unused slots
    keys = [torch.randn(n, hkv, d, generator=g) for n in ctx_lens]
    vals = [torch.randn(n, hkv, d, generator=g) for n in ctx_lens]

    def batch(which):  # which="prefix" | "new"
        ids, pos, qsl = [], [], [0]
        for n, ql in zip(ctx_lens, q_lens):
            r = range(0, n - ql) if which == "prefix" else range(n - ql, n)
            pos += r
            qsl.append(qsl[-1] + len(r))
        lens = [n - ql for n, ql in zip(ctx_lens, q_lens)] if which == "prefix" else ctx_lens
        return ForwardBatch(
            input_ids=torch.zeros(len(pos), dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            page_table=page_table,
        )

    for which in ("prefix", "new"):
        b = batch(which)
        meta = ops.AttentionMetadata.build(b, page_size)
        sel = [(i, p) for i, (n, ql) in enumerate(zip(ctx_lens, q_lens))
               for p in (range(0, n - ql) if which == "prefix" else range(n - ql, n))]
        k = torch.stack([keys[i][p] for i, p in sel]) if sel else torch.zeros(0, hkv, d)
        v = torch.stack([vals[i][p] for i, p in sel]) if sel else torch.zeros(0, hkv, d)
        ops.write_kv(kv_cache, k, v, meta.slot_mapping)
    return kv_cache, batch("new"), keys, vals


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_attention_equals_dense_causal_attention(page_size):
    """Mixed batch: a decode token over a long prefix, a fresh prefill, a chunk over a cached
    prefix, a single-token sequence; GQA 4 query heads per KV head."""
    ctx_lens, q_lens = [37, 9, 21, 1], [1, 9, 6, 1]
    hq, hkv, d = 8, 2, 16
    kv_cache, batch, keys, vals = _paged_setup(ctx_lens, q_lens, page_size, hkv, d, seed=5)
    q = _rand(sum(q_lens), hq, d, seed=6)
    meta = ops.AttentionMetadata.build(batch, page_size)
    out = ops.paged_attention(q, kv_cache, meta, scale=d**-0.5)
    qsl = batch.query_start_loc.tolist()
    for i, (n, ql) in enumerate(zip(ctx_lens, q_lens)):
        qi = q[qsl[i] : qsl[i + 1]].transpose(0, 1)[None]  # [1, Hq, L, D]
        k = keys[i].transpose(0, 1).repeat_interleave(hq // hkv, 0)[None]  # [1, Hq, n, D]
        v = vals[i].transpose(0, 1).repeat_interleave(hq // hkv, 0)[None]
        mask = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]  # [L, n]
        want = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask)[0].transpose(0, 1)
        got = out[qsl[i] : qsl[i + 1]]
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5, f"sequence {i}"


def test_write_kv_uses_hnd_pages():
    """Token at position p of a sequence lands in page_table[p // ps], offset p % ps, heads leading."""
    ps, hkv, d = 4, 2, 8
    batch = ForwardBatch(
        input_ids=torch.zeros(6, dtype=torch.int64),
        positions=torch.tensor([0, 1, 2, 3, 4, 5]),
        query_start_loc=torch.tensor([0, 6], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        page_table=torch.tensor([[3, 1]], dtype=torch.int32),
    )
    cache = torch.zeros(4, 2, hkv, ps, d)
    k, v = _rand(6, hkv, d, seed=7), _rand(6, hkv, d, seed=8)
    ops.write_kv(cache, k, v, ops.AttentionMetadata.build(batch, ps).slot_mapping)
    assert torch.equal(cache[3, 0, :, 2], k[2]) and torch.equal(cache[1, 1, :, 1], v[5])
    assert torch.equal(cache[0], torch.zeros_like(cache[0])) and torch.equal(cache[2], torch.zeros_like(cache[2]))


def test_missing_page_is_named():
    batch = ForwardBatch(
        input_ids=torch.zeros(2, dtype=torch.int64),
        positions=torch.tensor([3, 4]),
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        page_table=torch.tensor([[0, -1]], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="position 4"):
        ops.AttentionMetadata.build(batch, 4)


def test_qwen3_5_interleaved_mrope_on_text_positions_is_plain_rope():
    """Qwen3.5's real RoPE (head_dim 256, partial 0.25, interleaved mrope [11, 11, 10]): with the
    three position rows equal (text), transformers' tables equal our plain-RoPE tables."""
    rope = {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    hf_cfg = Qwen3_5MoeTextConfig(head_dim=256, rope_parameters=rope)
    pos = torch.tensor([0, 1, 5, 63, 64, 1000, 32767])
    cos_hf, sin_hf = Qwen3_5MoeTextRotaryEmbedding(hf_cfg)(torch.zeros(1), pos[None, None].expand(3, 1, -1))
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    assert cfg.rotary_dim == 64
    cos, sin = ops.rope_cos_sin(pos, rope_inv_freq(cfg), torch.float32)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])


def test_short_page_table_is_named():
    batch = ForwardBatch(
        input_ids=torch.zeros(1, dtype=torch.int64),
        positions=torch.tensor([8]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([9], dtype=torch.int32),
        page_table=torch.tensor([[0, 1]], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="seq_len 9"):
        ops.AttentionMetadata.build(batch, 4)
