"""GatedDeltaNet against transformers' Qwen3-Next and Qwen3.5-MoE modules (same weights, CPU, fp32),
driven through state slots: whole and chunked prefill, decode, mixed batches, speculative verify."""
import os

import pytest
import torch
from transformers import DynamicCache, Qwen3NextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from nvl72.model.batch import ForwardBatch
from nvl72.model.gdn import GatedDeltaNet

KINDS = {"qwen3_next": (Qwen3NextConfig, Qwen3NextGatedDeltaNet),
         "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeGatedDeltaNet)}
NUM_SLOTS = 8
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")
LAYER = 1


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Pair:
    """A transformers GDN module and ours with the same (random) weights, plus our state slots."""

    def __init__(self, kind, seed=0):
        torch.manual_seed(seed)
        config_cls, hf_cls = KINDS[kind]
        self.config = config_cls(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                 vocab_size=64)
        self.hf = hf_cls(self.config, LAYER).eval()
        with torch.no_grad():
            # Mild decays so state carried across chunks still shapes the outputs.
            self.hf.A_log.copy_(torch.empty(4).uniform_(0.01, 0.3).log())
            self.hf.dt_bias.copy_(torch.randn(4) * 0.5)
            self.hf.norm.weight.copy_(1 + 0.3 * torch.randn(12))
        self.ours = GatedDeltaNet(self.config, LAYER)
        self.ours.load_state_dict(self.hf.state_dict(), strict=True)
        conv_shape, rec_shape = GatedDeltaNet.state_shapes(self.config)
        self.conv = torch.randn(NUM_SLOTS, *conv_shape)  # garbage in unused slots must not leak
        self.rec = torch.randn(NUM_SLOTS, *rec_shape)

    def fresh(self, slot):
        self.conv[slot] = 0
        self.rec[slot] = 0

    @torch.no_grad()
    def run(self, seqs, hint=False, packed=False):
        """seqs: list of (hidden [L, H], read_slot, write_slots [L]) -> our outputs, one per sequence;
        hint: pass the host-side max_query_len; packed: through `packed_in_proj` and `mix_packed` (the
        decode path of the fused backends: Triton's kernel, interpreted on CPU)."""
        lens = [h.shape[0] for h, _, _ in seqs]
        qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        T = int(qsl[-1])
        batch = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long),
                             query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                             page_table=torch.zeros(len(seqs), 0, dtype=torch.int32),
                             state_read_slots=torch.tensor([r for _, r, _ in seqs]),
                             state_write_slots=torch.tensor([w for _, _, ws in seqs for w in ws]),
                             max_query_len=max(lens) if hint else None)
        x = torch.cat([h for h, _, _ in seqs])
        if packed:
            proj = torch.nn.functional.linear(x, self.ours.packed_in_proj()[0])
            out = self.ours.out_proj(self.ours.mix_packed(proj, batch, self.conv, self.rec))
        else:
            out = self.ours(x, batch, self.conv, self.rec)
        return list(out.split(lens))

    @torch.no_grad()
    def hf_run(self, chunks):
        """Feed one sequence's chunks through transformers with a cache -> (outputs per chunk,
        (conv tail, recurrent state) after each chunk)."""
        cache = DynamicCache(config=self.config)
        outs, states = [], []
        for h in chunks:
            outs.append(self.hf(h[None], cache_params=cache)[0])
            layer = cache.layers[LAYER]
            # transformers keeps the last K inputs; the first is never read again, we keep K-1.
            states.append((layer.conv_states[0][0, :, 1:].clone(), layer.recurrent_states[0][0].clone()))
        return outs, states

    def assert_state(self, slot, state):
        assert rel_err(self.conv[slot], state[0]) < 1e-5
        assert rel_err(self.rec[slot], state[1]) < 1e-4


def writes(L, slot):
    """A prefill chunk's write slots: only after its last token."""
    return [-1] * (L - 1) + [slot]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("L", [10, 70])
def test_whole_prefill(kind, L):
    p = Pair(kind)
    h = torch.randn(L, 32)
    p.fresh(3)
    (out,) = p.run([(h, 3, writes(L, 5))])
    (ref,), (state,) = p.hf_run([h])
    assert rel_err(out, ref) < 1e-4
    assert rel_err(out, p.hf(h[None])[0]) < 1e-4  # no-cache transformers path agrees too
    p.assert_state(5, state)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_in_two_chunks(kind):
    p = Pair(kind, seed=1)
    h = torch.randn(75, 32)
    p.fresh(2)
    (o1,) = p.run([(h[:40], 2, writes(40, 2))])
    (o2,) = p.run([(h[40:], 2, writes(35, 2))])
    (r1, r2), (_, state) = p.hf_run([h[:40], h[40:]])
    assert rel_err(o1, r1) < 1e-4 and rel_err(o2, r2) < 1e-4
    assert rel_err(torch.cat([o1, o2]), p.hf(h[None])[0]) < 1e-4
    p.assert_state(2, state)


@pytest.mark.parametrize("kind", KINDS)
def test_token_by_token_decode(kind):
    p = Pair(kind, seed=2)
    h = torch.randn(25, 32)
    p.fresh(4)
    outs = p.run([(h[:20], 4, writes(20, 4))])
    for t in range(20, 25):
        outs += p.run([(h[t:t + 1], 4, [4])])
    refs, states = p.hf_run([h[:20]] + [h[t:t + 1] for t in range(20, 25)])
    for o, r in zip(outs, refs):
        assert rel_err(o, r) < 1e-4
    p.assert_state(4, states[-1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recurrent_max,hint", [(GatedDeltaNet.RECURRENT_MAX_TOKENS, False),
                                                (GatedDeltaNet.RECURRENT_MAX_TOKENS, True), (0, False), (100, True)])
def test_mixed_batch(kind, recurrent_max, hint):
    """A continued prefill chunk, a fresh prefill and a decode token in one batch, with scattered slots;
    recurrent_max=0 sends every sequence through the chunked rule, 100 every one through the recurrent."""
    p = Pair(kind, seed=3)
    p.ours.RECURRENT_MAX_TOKENS = recurrent_max
    ha, hb, hc = torch.randn(55, 32), torch.randn(18, 32), torch.randn(8, 32)
    p.fresh(5)
    p.fresh(0)
    p.run([(ha[:30], 5, writes(30, 5)), (hc[:7], 0, writes(7, 0))])  # earlier step: prefixes of a and c
    p.fresh(3)
    oa, ob, oc = p.run([(ha[30:], 5, writes(25, 1)), (hb, 3, writes(18, 3)), (hc[7:], 0, [6])], hint)
    for o, h, split, slot in ((oa, ha, 30, 1), (ob, hb, 0, 3), (oc, hc, 7, 6)):
        refs, states = p.hf_run([h[:split], h[split:]] if split else [h])
        assert rel_err(o, refs[-1]) < 1e-4
        p.assert_state(slot, states[-1])
    assert not torch.equal(p.rec[1], p.rec[5])  # the read slot of a is not the slot it wrote


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recurrent_max", [GatedDeltaNet.RECURRENT_MAX_TOKENS, 0])
def test_spec_verify_writes_each_position(kind, recurrent_max):
    """4 draft tokens, each position's state into its own slot (the first reuses the read slot); each
    written state equals transformers' state after the prefix up to that token, by either rule."""
    p = Pair(kind, seed=4)
    p.ours.RECURRENT_MAX_TOKENS = recurrent_max
    h = torch.randn(16, 32)
    p.fresh(2)
    p.run([(h[:12], 2, writes(12, 2))])
    slots = [2, 4, 7, 1]
    (out,) = p.run([(h[12:], 2, slots)])
    refs, states = p.hf_run([h[:12]] + [h[t:t + 1] for t in range(12, 16)])
    assert rel_err(out, torch.cat(refs[1:])) < 1e-4
    for slot, state in zip(slots, states[1:]):
        p.assert_state(slot, state)


@INTERPRETED
@pytest.mark.parametrize("kind", KINDS)
def test_packed_mix_decode_and_verify(kind):
    """`mix_packed` (one kernel reading q, k, v, z, b, a out of the packed projections, either checkpoint
    layout): token-by-token decode and a 4-token verify writing a state per position against transformers;
    a batch of short sequences (one writing its own read slot, one position not written) against the
    unfused layer from the same slots, every slot compared."""
    p = Pair(kind, seed=5)
    h = torch.randn(24, 32)
    p.fresh(4)
    outs = p.run([(h[:16], 4, writes(16, 4))])
    for t in range(16, 20):
        outs += p.run([(h[t:t + 1], 4, [4])], hint=True, packed=True)
    slots = [4, 6, 7, 1]
    outs += p.run([(h[20:], 4, slots)], hint=True, packed=True)
    refs, states = p.hf_run([h[:16]] + [h[t:t + 1] for t in range(16, 24)])
    assert rel_err(torch.cat(outs), torch.cat(refs)) < 1e-4
    for slot, state in zip(slots, states[5:]):
        p.assert_state(slot, state)
    seqs = [(torch.randn(3, 32), 6, [2, 2, 2]), (torch.randn(1, 32), 7, [7]), (torch.randn(2, 32), 1, [-1, 0])]
    conv, rec = p.conv.clone(), p.rec.clone()
    want = p.run(seqs, hint=True)
    want_conv, want_rec, p.conv, p.rec = p.conv, p.rec, conv, rec
    got = p.run(seqs, hint=True, packed=True)
    assert rel_err(torch.cat(got), torch.cat(want)) < 1e-4
    assert rel_err(p.conv, want_conv) < 1e-5 and rel_err(p.rec, want_rec) < 1e-5
    assert torch.equal(p.rec[3], want_rec[3]) and torch.equal(p.conv[5], want_conv[5])  # slots nobody wrote


def test_state_shapes_match_transformers_cache():
    p = Pair("qwen3_next")
    conv_shape, rec_shape = GatedDeltaNet.state_shapes(p.config)
    _, states = p.hf_run([torch.randn(3, 32)])
    assert conv_shape == tuple(states[0][0].shape) and rec_shape == tuple(states[0][1].shape)


def test_bad_inputs_raise():
    p = Pair("qwen3_5_moe")
    h = torch.randn(3, 32)
    with pytest.raises(ValueError, match=r"got \(8, 40, 4\)"):
        p.ours(h, ForwardBatch(torch.zeros(3), torch.zeros(3), torch.tensor([0, 3]), torch.tensor([3]),
                               torch.zeros(1, 0), torch.tensor([0]), torch.tensor([-1, -1, 0])),
               torch.zeros(8, 40, 4), p.rec)
    with pytest.raises(ValueError, match="got None"):
        p.ours(h, ForwardBatch(torch.zeros(3), torch.zeros(3), torch.tensor([0, 3]), torch.tensor([3]),
                               torch.zeros(1, 0)), p.conv, p.rec)
    with pytest.raises(TypeError, match="bfloat16"):
        p.ours(h, ForwardBatch(torch.zeros(3), torch.zeros(3), torch.tensor([0, 3]), torch.tensor([3]),
                               torch.zeros(1, 0), torch.tensor([0]), torch.tensor([-1, -1, 0])),
               p.conv, p.rec.bfloat16())
    with pytest.raises(ValueError, match="'llama'"):
        GatedDeltaNet(type("C", (), {"model_type": "llama"})(), 0)
