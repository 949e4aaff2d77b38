"""Reference ops of the Gated DeltaNet layer: chunked == recurrent rule, slot reads/writes."""
import pytest
import torch
import torch.nn.functional as F

from nvl72.model.gdn_ops import (causal_conv1d, chunk_gated_delta_rule, gated_rmsnorm, gdn_gating,
                                 recurrent_gated_delta_rule)

HK, HV, DK, DV = 2, 4, 16, 8


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(T, gen):
    q = torch.randn(T, HK, DK, generator=gen)
    k = torch.randn(T, HK, DK, generator=gen)
    v = torch.randn(T, HV, DV, generator=gen)
    a = torch.randn(T, HV, generator=gen)
    b = torch.randn(T, HV, generator=gen)
    A_log = torch.empty(HV).uniform_(0.01, 16, generator=gen).log()
    g, beta = gdn_gating(A_log, a, torch.randn(HV, generator=gen), b)
    return q, k, v, g, beta


@pytest.mark.parametrize("L", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(L, with_state):
    gen = torch.Generator().manual_seed(L * 2 + with_state)
    q, k, v, g, beta = _inputs(L, gen)
    init = torch.randn(1, HV, DK, DV, generator=gen) if with_state else torch.zeros(1, HV, DK, DV)
    cu = torch.tensor([0, L])
    o_c, final = chunk_gated_delta_rule(q, k, v, g, beta, cu, init.clone())
    # Slot 2 holds the start state, the final state goes to slot 0 (others untouched).
    state = torch.randn(3, HV, DK, DV, generator=gen)
    state[2] = init[0]
    untouched = state[1].clone()
    write = torch.full((L,), -1)
    write[-1] = 0
    o_r = recurrent_gated_delta_rule(q, k, v, g, beta, state, cu, torch.tensor([2]), write)
    assert rel_err(o_c, o_r) < 1e-4
    assert rel_err(final[0], state[0]) < 1e-4
    assert torch.equal(state[1], untouched) and torch.equal(state[2], init[0])


def test_varlen_batches_are_independent():
    """Several sequences in one call give what each gives alone, in both rules."""
    gen = torch.Generator().manual_seed(7)
    lens = [5, 70, 1]
    cu = torch.tensor([0, 5, 75, 76])
    q, k, v, g, beta = _inputs(76, gen)
    init = torch.randn(3, HV, DK, DV, generator=gen)
    o_all, fin_all = chunk_gated_delta_rule(q, k, v, g, beta, cu, init)
    state = init.clone()
    write = torch.full((76,), -1)
    write[cu[1:] - 1] = torch.tensor([0, 1, 2])
    o_rec = recurrent_gated_delta_rule(q, k, v, g, beta, state, cu, torch.tensor([0, 1, 2]), write)
    for i, L in enumerate(lens):
        s, e = cu[i].item(), cu[i + 1].item()
        o_i, fin_i = chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], torch.tensor([0, L]),
                                            init[i:i + 1])
        assert rel_err(o_all[s:e], o_i) < 1e-5 and rel_err(fin_all[i], fin_i[0]) < 1e-5
    assert rel_err(o_rec, o_all) < 1e-4 and rel_err(state, fin_all) < 1e-4


def test_recurrent_writes_every_position():
    """A verify-style sequence writing each position's state into its own slot (first one = read slot)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _inputs(4, gen)
    state = torch.randn(6, HV, DK, DV, generator=gen)
    init = state[1].clone()
    write = torch.tensor([1, 3, 4, 5])
    recurrent_gated_delta_rule(q, k, v, g, beta, state, torch.tensor([0, 4]), torch.tensor([1]), write)
    for j in range(4):
        _, fin = chunk_gated_delta_rule(q[:j + 1], k[:j + 1], v[:j + 1], g[:j + 1], beta[:j + 1],
                                        torch.tensor([0, j + 1]), init[None])
        assert rel_err(state[write[j]], fin[0]) < 1e-5


def test_causal_conv1d_continues_from_slots():
    gen = torch.Generator().manual_seed(5)
    D, K = 12, 4
    w = torch.randn(D, K, generator=gen)
    x = torch.randn(9, D, generator=gen)
    conv_state = torch.randn(4, D, K - 1, generator=gen)
    tail0 = conv_state[3].clone()
    cu = torch.tensor([0, 2, 9])  # seq 0: 2 tokens from slot 3; seq 1: 7 tokens from slot 1
    tail1 = conv_state[1].clone()
    write = torch.tensor([3, 0, -1, -1, -1, -1, -1, -1, 2])
    out = causal_conv1d(x, w, conv_state, cu, torch.tensor([3, 1]), write)
    for tail, s, e in ((tail0, 0, 2), (tail1, 2, 9)):
        full = torch.cat([tail, x[s:e].t()], dim=1)[None]  # [1, D, K-1+L]
        ref = F.silu(F.conv1d(full, w[:, None], groups=D))[0].t()  # [L, D]
        assert rel_err(out[s:e], ref) < 1e-5
    assert torch.equal(conv_state[3], torch.cat([tail0, x[0:1].t()], 1)[:, 1:])
    assert torch.equal(conv_state[0], torch.cat([tail0, x[0:2].t()], 1)[:, -(K - 1):])
    assert torch.equal(conv_state[2], x[9 - (K - 1):9].t())


def test_gated_rmsnorm_matches_formula():
    gen = torch.Generator().manual_seed(11)
    x, z = torch.randn(5, 3, 8, generator=gen), torch.randn(5, 3, 8, generator=gen)
    w = torch.randn(8, generator=gen)
    ref = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * z * torch.sigmoid(z)
    assert rel_err(gated_rmsnorm(x, z, w, 1e-6), ref) < 1e-5


def test_bad_heads_raise():
    q = torch.randn(3, 3, 4)
    with pytest.raises(ValueError, match="value heads 4"):
        recurrent_gated_delta_rule(q, q, torch.randn(3, 4, 4), torch.zeros(3, 4), torch.zeros(3, 4),
                                   torch.zeros(1, 4, 4, 4), torch.tensor([0, 3]), torch.tensor([0]),
                                   torch.full((3,), -1))
