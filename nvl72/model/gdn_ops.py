"""Pure-torch reference ops of the Gated DeltaNet layer (Qwen3-Next / Qwen3.5 MoE).

Every op works on a flattened mixed batch (sequence `i` owns tokens
`query_start_loc[i]:query_start_loc[i+1]`) and, where it touches per-request state, on state *slots*:
the state of sequence `i` is read from slot `read_slots[i]`, and the state after token `t` is written
to slot `write_slots[t]` when that is >= 0. All reads happen before any write (a write slot may equal
a read slot). GPU kernels take the same signatures (`gdn_triton.py`); these references run on CPU and
are what the kernels are tested against.

Recurrence per value head (state S is [Dk, Dv], fp32; q and k are L2-normalised, q scaled by Dk^-0.5):
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,      o_t = S_t^T q_t
Key heads are shared by `Hv // Hk` consecutive value heads (as transformers' repeat_interleave).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
               b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay and write strength per token and value head: g = -exp(A_log) * softplus(a + dt_bias)
    (fp32, log space, <= 0) and beta = sigmoid(b) (in b's dtype, as transformers).

    A_log, dt_bias: [Hv];  a, b: [T, Hv]  ->  g [T, Hv] fp32, beta [T, Hv]
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with a plain weight (initialised to ones, not zero-centred), then a
    SiLU gate: `weight * norm(x) * silu(z)`, rounding to x's dtype where transformers does.

    x, z: [..., D];  weight: [D]
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(z.float())).to(dtype)


def _seq_ids(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sequence index of every token: [T] int64."""
    lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    return torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens,
                                   output_size=num_tokens)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  query_start_loc: torch.Tensor, read_slots: torch.Tensor,
                  write_slots: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over each sequence, continuing from the K-1 inputs held in its
    read slot; writes the K-1 inputs ending at token t into `conv_state[write_slots[t]]` (in place).

    x: [T, D];  weight: [D, K];  conv_state: [S, D, K-1];  query_start_loc: [B+1];
    read_slots: [B];  write_slots: [T]  ->  [T, D] in x's dtype
    """
    T, D = x.shape
    K = weight.shape[1]
    B = read_slots.shape[0]
    seq = _seq_ids(query_start_loc, T)  # [T]
    # Each sequence's K-1 tail rows followed by its tokens, sequences back to back: [T + B*(K-1), D].
    ext = x.new_empty(T + B * (K - 1), D, dtype=torch.float32)
    pos = torch.arange(T, device=x.device) + (seq + 1) * (K - 1)  # [T] row of token t in ext
    tail_rows = (query_start_loc[:-1].long() + torch.arange(B, device=x.device) * (K - 1))[:, None] \
        + torch.arange(K - 1, device=x.device)  # [B, K-1]
    ext[tail_rows.reshape(-1)] = conv_state[read_slots].transpose(1, 2).reshape(-1, D).float()
    ext[pos] = x.float()
    window = pos[:, None] + torch.arange(-(K - 1), 1, device=x.device)  # [T, K]
    win = ext[window]  # [T, K, D]
    out = F.silu((win * weight.float().t()).sum(1))  # [T, D]
    w = write_slots >= 0
    if bool(w.any()):
        conv_state[write_slots[w]] = win[w, 1:].transpose(1, 2).to(conv_state.dtype)  # [W, D, K-1]
    return out.to(x.dtype)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int,
                use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q/k repeated onto the value heads, optionally L2-normalised (eps 1e-6 inside the root, as
    transformers and FLA), q scaled by Dk^-0.5.  q, k: [T, Hk, Dk] -> [T, Hv, Dk]."""
    rep = num_v_heads // q.shape[1]
    q, k = q.float().repeat_interleave(rep, dim=1), k.float().repeat_interleave(rep, dim=1)
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.shape != k.shape or q.dim() != 3 or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if v.shape[1] % q.shape[1]:
        raise ValueError(f"value heads {v.shape[1]} are not a multiple of key heads {q.shape[1]}")


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                           read_slots: torch.Tensor, write_slots: torch.Tensor, chunk_size: int = 64,
                           use_qk_l2norm: bool = True) -> torch.Tensor:
    """Gated delta rule in chunks (prefill), same contract as `recurrent_gated_delta_rule`: within a
    chunk the delta-rule updates fold into matmuls through the WY/UT form,
    (I + tril(beta k k^T * decay, -1))^-1, and the fp32 state is carried from chunk to chunk. The state
    after any token (not only the last) can be written, so the two rules are interchangeable.

    q, k: [T, Hk, Dk];  v: [T, Hv, Dv];  g, beta: [T, Hv];  state: [S, Hv, Dk, Dv] fp32;
    query_start_loc: [B+1];  read_slots: [B];  write_slots: [T]  ->  o [T, Hv, Dv] in v's dtype
    """
    _check_heads(q, k, v)
    Hv, Dv = v.shape[1:]
    C = chunk_size
    q, k = _prepare_qk(q, k, Hv, use_qk_l2norm)
    vf, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()  # [C, C] j <= i
    eye = torch.eye(C, device=v.device)
    bounds = query_start_loc.tolist()
    writes = write_slots.tolist()
    init = state[read_slots].float()  # [B, H, Dk, Dv], read before any write
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        L = e - s
        pad = (-L) % C
        n = (L + pad) // C
        # [L, H, D] -> [H, n, C, D]; zero padding leaves the state untouched (k = 0, g = 0).
        qs, ks, vs = (F.pad(t[s:e], (0, 0, 0, 0, 0, pad)).view(n, C, Hv, -1).permute(2, 0, 1, 3)
                      for t in (q, k, vf))
        gs, bs = (F.pad(t[s:e], (0, 0, 0, pad)).view(n, C, Hv).permute(2, 0, 1) for t in (g, beta))
        gam = gs.cumsum(-1)  # [H, n, C] log decay from chunk start through position i
        decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, n, C, C]
        kb = ks * bs[..., None]
        A = (kb @ ks.transpose(-1, -2) * decay).tril(-1)  # [H, n, C, C] strictly lower
        u = torch.linalg.solve_triangular(eye + A, vs * bs[..., None], upper=False)  # [H, n, C, Dv]
        w = torch.linalg.solve_triangular(eye + A, kb * gam.exp()[..., None], upper=False)  # [H, n, C, Dk]
        attn = qs @ ks.transpose(-1, -2) * decay  # [H, n, C, C]
        q_dec = qs * gam.exp()[..., None]
        k_dec = ks * (gam[..., -1:] - gam).exp()[..., None]
        S = init[i]  # [H, Dk, Dv]
        o = torch.empty(Hv, n, C, Dv, device=v.device)
        for c in range(n):
            v_new = u[:, c] - w[:, c] @ S  # [H, C, Dv]
            o[:, c] = q_dec[:, c] @ S + attn[:, c] @ v_new
            pos = [p for p in range(min(C, L - c * C)) if writes[s + c * C + p] >= 0]
            if pos:
                # State after position p: exp(gam_p) S + sum_{j <= p} exp(gam_p - gam_j) k_j v_new_j^T.
                k_p = ks[:, c, None] * decay[:, c, pos, :, None]  # [H, P, C, Dk]
                S_p = gam[:, c, pos].exp()[..., None, None] * S[:, None] + k_p.transpose(-1, -2) @ v_new[:, None]
                state[[writes[s + c * C + p] for p in pos]] = S_p.transpose(0, 1).to(state.dtype)  # [P, H, Dk, Dv]
            S = S * gam[:, c, -1].exp()[:, None, None] + k_dec[:, c].transpose(-1, -2) @ v_new
        out[s:e] = o.permute(1, 2, 0, 3).reshape(n * C, Hv, Dv)[:L]  # [L, H, Dv]
    return out.to(v.dtype)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                               read_slots: torch.Tensor, write_slots: torch.Tensor,
                               use_qk_l2norm: bool = True) -> torch.Tensor:
    """Gated delta rule token by token (decode, speculative verify): each sequence starts from
    `state[read_slots[i]]`, and the state after token t goes to `state[write_slots[t]]` (in place),
    so a verify step can keep every draft position's state.

    q, k: [T, Hk, Dk];  v: [T, Hv, Dv];  g, beta: [T, Hv];  state: [S, Hv, Dk, Dv] fp32;
    query_start_loc: [B+1];  read_slots: [B];  write_slots: [T]  ->  o [T, Hv, Dv] in v's dtype
    """
    _check_heads(q, k, v)
    Hv = v.shape[1]
    q, k = _prepare_qk(q, k, Hv, use_qk_l2norm)
    vf, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts  # [B]
    S = state[read_slots].float()  # [B, H, Dk, Dv]
    for j in range(int(lens.max()) if lens.numel() else 0):
        active = lens > j  # [B]
        tok = torch.where(active, starts + j, 0)  # [B]
        kt, qt = k[tok], q[tok]  # [B, H, Dk]
        S_dec = S * g[tok].exp()[..., None, None]
        delta = (vf[tok] - (S_dec * kt[..., None]).sum(-2)) * beta[tok][..., None]  # [B, H, Dv]
        S = torch.where(active[:, None, None, None], S_dec + kt[..., None] * delta[..., None, :], S)
        out[tok[active]] = (S * qt[..., None]).sum(-2)[active]
        slots = torch.where(active, write_slots[tok], -1)
        w = slots >= 0
        if bool(w.any()):
            state[slots[w]] = S[w].to(state.dtype)
    return out.to(v.dtype)
