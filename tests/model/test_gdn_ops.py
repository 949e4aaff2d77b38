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


def _run_both(q, k, v, g, beta, state, qsl, read, write):
    """Both rules on copies of `state` -> (o_chunked, state_chunked, o_recurrent, state_recurrent)."""
    s_c, s_r = state.clone(), state.clone()
    o_c = chunk_gated_delta_rule(q, k, v, g, beta, s_c, qsl, read, write)
    o_r = recurrent_gated_delta_rule(q, k, v, g, beta, s_r, qsl, read, write)
    return o_c, s_c, o_r, s_r


@pytest.mark.parametrize("L", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(L, with_state):
    gen = torch.Generator().manual_seed(L * 2 + with_state)
    q, k, v, g, beta = _inputs(L, gen)
    # Slot 2 holds the start state (zero for a fresh sequence), the final state goes to slot 0.
    state = torch.randn(3, HV, DK, DV, generator=gen)
    if not with_state:
        state[2] = 0
    write = torch.full((L,), -1)
    write[-1] = 0
    o_c, s_c, o_r, s_r = _run_both(q, k, v, g, beta, state, torch.tensor([0, L]), torch.tensor([2]), write)
    assert rel_err(o_c, o_r) < 1e-4
    assert rel_err(s_c[0], s_r[0]) < 1e-4
    assert torch.equal(s_c[1:], state[1:]) and torch.equal(s_r[1:], state[1:])  # untouched


def test_writes_at_any_position():
    """States after arbitrary tokens (inside chunks, at chunk edges; the first into the read slot) agree
    between the rules and with a run of the prefix alone."""
    gen = torch.Generator().manual_seed(9)
    L = 130
    q, k, v, g, beta = _inputs(L, gen)
    state = torch.randn(8, HV, DK, DV, generator=gen)
    positions, slots = [0, 5, 63, 64, 100, 129], [1, 2, 3, 4, 5, 6]
    write = torch.full((L,), -1)
    write[positions] = torch.tensor(slots)
    o_c, s_c, o_r, s_r = _run_both(q, k, v, g, beta, state, torch.tensor([0, L]), torch.tensor([1]), write)
    assert rel_err(o_c, o_r) < 1e-4 and rel_err(s_c, s_r) < 1e-4
    for p, slot in zip(positions, slots):
        prefix = torch.full((p + 1,), -1)
        prefix[-1] = 7
        s_p = state.clone()
        chunk_gated_delta_rule(q[:p + 1], k[:p + 1], v[:p + 1], g[:p + 1], beta[:p + 1], s_p,
                               torch.tensor([0, p + 1]), torch.tensor([1]), prefix)
        assert rel_err(s_c[slot], s_p[7]) < 1e-5


def test_varlen_batches_are_independent():
    """Several sequences in one call give what each gives alone, in both rules."""
    gen = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 5, 75, 76])
    q, k, v, g, beta = _inputs(76, gen)
    state = torch.randn(6, HV, DK, DV, generator=gen)
    read = torch.tensor([0, 1, 2])
    write = torch.full((76,), -1)
    write[cu[1:] - 1] = torch.tensor([3, 4, 2])  # the last sequence writes its own read slot
    o_c, s_c, o_r, s_r = _run_both(q, k, v, g, beta, state, cu, read, write)
    assert rel_err(o_c, o_r) < 1e-4 and rel_err(s_c, s_r) < 1e-4
    for i in range(3):
        s, e = cu[i].item(), cu[i + 1].item()
        alone = state.clone()
        o_i = chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], alone, torch.tensor([0, e - s]),
                                     read[i:i + 1], write[s:e])
        assert rel_err(o_c[s:e], o_i) < 1e-5
        assert rel_err(s_c[write[e - 1]], alone[write[e - 1]]) < 1e-5


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
