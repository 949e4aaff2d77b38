"""Pure-torch reference ops of the Gated DeltaNet layer (Qwen3-Next / Qwen3.5 MoE).

Every op works on a flattened mixed batch (sequence `i` owns tokens
`query_start_loc[i]:query_start_loc[i+1]`) and, where it touches per-request state, on state *slots*:
the state of sequence `i` is read from slot `read_slots[i]`, and the state after token `t` is written
to slot `write_slots[t]` when that is >= 0. A sequence may write its own read slot; a slot written by
one sequence must not be read by another in the same call (the references read every slot before any
write, the kernels only per sequence). GPU kernels take the same signatures (`gdn_triton.py`); these
references run on CPU and are what the kernels are tested against.

Recurrence per value head (state S is [Dk, Dv], fp32; q and k are L2-normalised, q scaled by Dk^-0.5):
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,      o_t = S_t^T q_t
Key heads are shared by `Hv // Hk` consecutive value heads (as transformers' repeat_interleave).
"""
from __future__ import annotations

from dataclasses import dataclass

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


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape check shared by the delta-rule ops and their kernels."""
    if q.shape != k.shape or q.dim() != 3 or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if v.shape[1] % q.shape[1]:
        raise ValueError(f"value heads {v.shape[1]} are not a multiple of key heads {q.shape[1]}")


@dataclass
class ChunkPlan:
    """How the tokens of a varlen batch fall into fixed-size chunks (a sequence's chunks are
    consecutive). Built once per call; shared by the torch and Triton scans."""

    tokens: torch.Tensor  # [N, C] int64 token row at each chunk position, T (one past the end) for padding
    write_slots: torch.Tensor  # [N, C] int64 slot to write after that position, -1 for none or padding
    seq_chunks: torch.Tensor  # [B+1] int64 cumulative chunk counts
    counts: list[int]  # chunks per sequence (host)


def plan_chunks(query_start_loc: torch.Tensor, write_slots: torch.Tensor, chunk_size: int) -> ChunkPlan:
    starts = query_start_loc.long()
    T = write_slots.shape[0]
    lens = starts[1:] - starts[:-1]  # [B]
    counts = ((lens + chunk_size - 1) // chunk_size).tolist()
    n = torch.tensor(counts, device=starts.device)
    N = sum(counts)
    seq_chunks = F.pad(n.cumsum(0), (1, 0))  # [B+1]
    seq = torch.repeat_interleave(torch.arange(len(counts), device=starts.device), n, output_size=N)  # [N]
    first = (starts[seq] + (torch.arange(N, device=starts.device) - seq_chunks[seq]) * chunk_size)  # [N]
    tok = first[:, None] + torch.arange(chunk_size, device=starts.device)  # [N, C]
    tokens = torch.where(tok < starts[1:][seq][:, None], tok, T)
    return ChunkPlan(tokens, F.pad(write_slots, (0, 1), value=-1)[tokens], seq_chunks, counts)


@dataclass
class ChunkTensors:
    """Per-chunk quantities of the WY/UT form, all fp32, contiguous, value heads leading per chunk:
    gam = within-chunk cumulative log decay, decay[i, j] = exp(gam_i - gam_j) for j <= i (else 0),
    u = T beta v and w = T beta exp(gam) k with T = (I + tril(beta k k^T * decay, -1))^-1,
    attn = (q k^T) * decay, q_dec = q exp(gam), k_dec = k exp(gam_last - gam)."""

    gam: torch.Tensor  # [N, H, C]
    decay: torch.Tensor  # [N, H, C, C]
    u: torch.Tensor  # [N, H, C, Dv]
    w: torch.Tensor  # [N, H, C, Dk]
    attn: torch.Tensor  # [N, H, C, C]
    q_dec: torch.Tensor  # [N, H, C, Dk]
    k: torch.Tensor  # [N, H, C, Dk]
    k_dec: torch.Tensor  # [N, H, C, Dk]


def prepare_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   plan: ChunkPlan, use_qk_l2norm: bool) -> ChunkTensors:
    """The intra-chunk part of the chunked rule, batched over every chunk of every sequence; padding
    positions get k = v = 0 and g = 0, so they leave the state untouched."""
    Hv = v.shape[1]
    C = plan.tokens.shape[1]
    q, k = _prepare_qk(q, k, Hv, use_qk_l2norm)

    def chunked(x):  # [T, H, ...] -> [N, H, C, ...] with a zero row for padding
        x = torch.cat([x.float(), x.new_zeros((1,) + x.shape[1:], dtype=torch.float32)])[plan.tokens]
        return x.transpose(1, 2).contiguous()

    qc, kc, vc, gc, bc = (chunked(x) for x in (q, k, v, g, beta))
    gam = gc.cumsum(-1)  # [N, H, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()  # j <= i
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [N, H, C, C]
    kb = kc * bc[..., None]
    unit_lower = torch.eye(C, device=v.device) + (kb @ kc.transpose(-1, -2) * decay).tril(-1)
    u = torch.linalg.solve_triangular(unit_lower, vc * bc[..., None], upper=False)
    w = torch.linalg.solve_triangular(unit_lower, kb * gam.exp()[..., None], upper=False)
    return ChunkTensors(gam, decay, u.contiguous(), w.contiguous(), (qc @ kc.transpose(-1, -2)) * decay,
                        qc * gam.exp()[..., None], kc, kc * (gam[..., -1:] - gam).exp()[..., None])


def unchunk(o: torch.Tensor, plan: ChunkPlan, num_tokens: int) -> torch.Tensor:
    """[N, H, C, Dv] per-chunk outputs -> [T, H, Dv] token rows (padding dropped)."""
    N, H, C, Dv = o.shape
    out = o.new_empty(num_tokens + 1, H, Dv)
    out[plan.tokens.reshape(-1)] = o.transpose(1, 2).reshape(N * C, H, Dv)
    return out[:num_tokens]


def _scan_chunks(ct: ChunkTensors, state: torch.Tensor, plan: ChunkPlan, read_slots: torch.Tensor) -> torch.Tensor:
    """The inter-chunk part: carry each sequence's state across its chunks (all sequences in step),
    writing the state after any position that asks for it. Returns per-chunk outputs [N, H, C, Dv]."""
    S = state[read_slots].float()  # [B, H, Dk, Dv], read before any write
    o = torch.empty_like(ct.u)
    first = plan.seq_chunks[:-1]
    counts = torch.tensor(plan.counts, device=S.device)
    for j in range(max(plan.counts, default=0)):
        act = (counts > j).nonzero().squeeze(1)  # [A] sequences with a chunk j
        c = first[act] + j  # [A] their chunk
        Sa = S[act]  # [A, H, Dk, Dv]
        v_new = ct.u[c] - ct.w[c] @ Sa  # [A, H, C, Dv]
        o[c] = ct.q_dec[c] @ Sa + ct.attn[c] @ v_new
        a_i, p_i = (plan.write_slots[c] >= 0).nonzero().unbind(1)  # written (sequence, position) pairs
        if a_i.numel():
            # State after position p: exp(gam_p) S + sum_{j <= p} exp(gam_p - gam_j) k_j v_new_j^T.
            cw = c[a_i]
            k_p = ct.k[cw] * ct.decay[cw, :, p_i][..., None]  # [W, H, C, Dk]
            S_p = ct.gam[cw, :, p_i].exp()[..., None, None] * Sa[a_i] + k_p.transpose(-1, -2) @ v_new[a_i]
            state[plan.write_slots[c][a_i, p_i]] = S_p.to(state.dtype)
        S[act] = Sa * ct.gam[c, :, -1].exp()[..., None, None] + ct.k_dec[c].transpose(-1, -2) @ v_new
    return o


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                           read_slots: torch.Tensor, write_slots: torch.Tensor, chunk_size: int = 64,
                           use_qk_l2norm: bool = True) -> torch.Tensor:
    """Gated delta rule in chunks (prefill), same contract as `recurrent_gated_delta_rule`: within a
    chunk the delta-rule updates fold into matmuls (`prepare_chunks`), and the fp32 state is carried
    from chunk to chunk (`_scan_chunks`). The state after any token (not only the last) can be
    written, so the two rules are interchangeable.

    q, k: [T, Hk, Dk];  v: [T, Hv, Dv];  g, beta: [T, Hv];  state: [S, Hv, Dk, Dv] fp32;
    query_start_loc: [B+1];  read_slots: [B];  write_slots: [T]  ->  o [T, Hv, Dv] in v's dtype
    """
    check_heads(q, k, v)
    plan = plan_chunks(query_start_loc, write_slots, chunk_size)
    ct = prepare_chunks(q, k, v, g, beta, plan, use_qk_l2norm)
    return unchunk(_scan_chunks(ct, state, plan, read_slots), plan, v.shape[0]).to(v.dtype)


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
    check_heads(q, k, v)
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
