"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5 MoE (3 of every 4 layers).

Per request it keeps two states in engine-owned slots: the conv tail (the last K-1 inputs of the
causal depthwise conv over q|k|v) and the recurrent state [Hv, Dk, Dv] (fp32). `ForwardBatch` says
which slot each sequence starts from and where the state after each token goes; the layer itself
never allocates state. Parameter names equal the checkpoint keys under `linear_attn.`:

    qwen3_next:  in_proj_qkvz, in_proj_ba (interleaved per key-head group), conv1d.weight,
                 dt_bias, A_log, norm.weight, out_proj
    qwen3_5_moe: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d.weight,
                 dt_bias, A_log, norm.weight, out_proj

Sequences longer than `RECURRENT_MAX_TOKENS` run the chunked rule (prefill), the others (decode,
speculative verify writing a state per draft position) the recurrent rule; both honour every write
slot and give the same result (tests/model/test_gdn_ops.py), so the choice is only about speed. When
`batch.max_query_len` is set and small, the layer needs no host copy of the batch (CUDA graphs).
A sequence may write its own read slot; a slot one sequence writes must not be another's read slot
in the same batch.

Tensor parallelism (`ParallelLayout`): a rank holds key heads `[k0, k0 + Hk/tp)` and the value heads
of their groups; its q | k | v conv channels (and conv state) are the three segments' slices, its
recurrent state its own value heads; `out_proj` is row-parallel (the decoder layer all-reduces).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from nvl72.model.batch import ForwardBatch
from nvl72.model.gdn_ops import (causal_conv1d, chunk_gated_delta_rule, gated_rmsnorm, gdn_gating,
                                 recurrent_gated_delta_rule)
from nvl72.model.parallel_layout import SINGLE, ParallelLayout
from nvl72.model.weights import PackedRows, shard_loader

_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
log = logging.getLogger(__name__)


class GdnOps(NamedTuple):
    """The device ops of the layer; each has the signature of its `gdn_ops` reference."""

    causal_conv1d: Callable
    recurrent: Callable
    chunked: Callable


@functools.cache
def gdn_ops_for(device_type: str) -> GdnOps:
    """The ops for a device type, chosen once and logged: the Triton kernels on CUDA when Triton
    imports, the torch references otherwise."""
    if device_type == "cuda":
        try:
            from nvl72.model import gdn_triton
        except ImportError as e:
            log.warning("GDN on cuda without Triton (%s): torch reference ops", e)
        else:
            log.info("GDN on cuda: Triton conv, recurrent-rule and chunk-scan kernels")
            return GdnOps(gdn_triton.causal_conv1d, gdn_triton.recurrent_gated_delta_rule,
                          gdn_triton.chunk_gated_delta_rule)
    log.info("GDN on %s: torch reference ops", device_type)
    return GdnOps(causal_conv1d, recurrent_gated_delta_rule, chunk_gated_delta_rule)


class GatedRMSNorm(nn.Module):
    """`weight * rmsnorm(x) * silu(z)` over one value head; holds `norm.weight`."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rmsnorm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """One GDN layer: projections -> causal conv (state slots) -> gated delta rule (state slots) ->
    gated RMSNorm -> out_proj (this rank's heads under TP; see the module docstring)."""

    RECURRENT_MAX_TOKENS = 16  # longer sequences take the chunked rule
    CHUNK_SIZE = 64

    def __init__(self, config, layer_idx: int, parallel: ParallelLayout = SINGLE, dtype=None, device=None):
        super().__init__()
        model_type = getattr(config, "model_type", None)
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"GatedDeltaNet does not support model_type {model_type!r}; "
                             f"expected one of {_MODEL_TYPES}")
        self.fused_qkvz = model_type == "qwen3_next"
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        if hv % hk:
            raise ValueError(f"linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}")
        k0, self.num_k_heads = parallel.split(hk, "linear_num_key_heads")
        self.num_v_heads = hv // parallel.tp_size
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        kw = dict(dtype=dtype, device=device)

        H = self.hidden_size
        if self.fused_qkvz:
            self.in_proj_qkvz = nn.Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False, **kw)
            self.in_proj_ba = nn.Linear(H, 2 * self.num_v_heads, bias=False, **kw)
        else:
            self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False, **kw)
            self.in_proj_z = nn.Linear(H, self.value_dim, bias=False, **kw)
            self.in_proj_b = nn.Linear(H, self.num_v_heads, bias=False, **kw)
            self.in_proj_a = nn.Linear(H, self.num_v_heads, bias=False, **kw)
        # Holds `conv1d.weight` [conv_dim, 1, K] with the checkpoint's name and init; the conv itself
        # runs through `causal_conv1d` so it can continue from the state slots.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim,
                                bias=False, **kw)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, **kw))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, **kw).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, **kw)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False, **kw)
        projs = ((self.in_proj_qkvz, self.in_proj_ba) if self.fused_qkvz
                 else (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))
        self.packed_in_proj = PackedRows(*projs)  # `mix_packed`'s input: one GEMV at batch 1
        if parallel.tp_size > 1:
            self._shard_loaders(k0, hk, hv)

    def _shard_loaders(self, k0: int, hk: int, hv: int) -> None:
        """Loaders that read this rank's rows of the full checkpoint tensors (key heads
        `[k0, k0 + num_k_heads)` of `hk`, value heads `[v0, v0 + num_v_heads)` of `hv`)."""
        Dk, Dv, tp_k, tp_v = self.head_k_dim, self.head_v_dim, self.key_dim, self.value_dim
        v0 = k0 * (hv // hk)
        kd, vd = hk * Dk, hv * Dv  # full key / value widths
        # conv channels (and Qwen3.5's in_proj_qkv rows): q | k | v segments, each sliced
        qkv = [(k0 * Dk, tp_k), (kd + k0 * Dk, tp_k), (2 * kd + v0 * Dv, tp_v)]
        self.conv1d.weight.weight_loader = shard_loader(0, qkv, 2 * kd + vd)
        per_v_head = [self.dt_bias, self.A_log]
        if self.fused_qkvz:  # rows grouped per key head: one contiguous block per rank
            group = 2 * Dk + 2 * (hv // hk) * Dv
            self.in_proj_qkvz.weight.weight_loader = shard_loader(0, [(k0 * group, self.num_k_heads * group)],
                                                                  hk * group)
            self.in_proj_ba.weight.weight_loader = shard_loader(0, [(2 * v0, 2 * self.num_v_heads)], 2 * hv)
        else:
            self.in_proj_qkv.weight.weight_loader = shard_loader(0, qkv, 2 * kd + vd)
            self.in_proj_z.weight.weight_loader = shard_loader(0, [(v0 * Dv, tp_v)], vd)
            per_v_head += [self.in_proj_b.weight, self.in_proj_a.weight]
        for p in per_v_head:
            p.weight_loader = shard_loader(0, [(v0, self.num_v_heads)], hv)
        self.out_proj.weight.weight_loader = shard_loader(1, [(v0 * Dv, tp_v)], vd)

    @staticmethod
    def state_shapes(config, tp_size: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes on one of `tp_size` ranks: conv tail (conv_dim, K-1) and recurrent
        state (Hv, Dk, Dv)."""
        hk, hv = config.linear_num_key_heads // tp_size, config.linear_num_value_heads // tp_size
        conv_dim = 2 * hk * config.linear_key_head_dim + hv * config.linear_value_head_dim
        return ((conv_dim, config.linear_conv_kernel_dim - 1),
                (hv, config.linear_key_head_dim, config.linear_value_head_dim))

    def _project(self, hidden: torch.Tensor):
        """Input projections -> mixed_qkv [T, conv_dim] (q | k | v, head-major), z [T, Hv, Dv],
        b and a [T, Hv]."""
        T = hidden.shape[0]
        if not self.fused_qkvz:
            return (self.in_proj_qkv(hidden), self.in_proj_z(hidden).view(T, self.num_v_heads, self.head_v_dim),
                    self.in_proj_b(hidden), self.in_proj_a(hidden))
        # qwen3_next interleaves per key-head group: [q_g, k_g, v_g (r heads), z_g (r heads)] and
        # [b_g (r), a_g (r)], with r = Hv // Hk value heads per key head.
        Hk, Dk, Dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // Hk
        qkvz = self.in_proj_qkvz(hidden).view(T, Hk, 2 * Dk + 2 * r * Dv)
        q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=-1)
        ba = self.in_proj_ba(hidden).view(T, Hk, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        mixed_qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)  # [T, conv_dim]
        return (mixed_qkv, z.reshape(T, self.num_v_heads, Dv), b.reshape(T, self.num_v_heads),
                a.reshape(T, self.num_v_heads))

    def _check(self, hidden: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [T, {self.hidden_size}], got {tuple(hidden.shape)}")
        conv_shape, rec_shape = (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim,
                                                                         self.head_v_dim)
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != conv_shape:
            raise ValueError(f"conv_state must be [slots, {conv_shape[0]}, {conv_shape[1]}], "
                             f"got {tuple(conv_state.shape)}")
        if recurrent_state.dim() != 4 or tuple(recurrent_state.shape[1:]) != rec_shape:
            raise ValueError(f"recurrent_state must be [slots, {', '.join(map(str, rec_shape))}], "
                             f"got {tuple(recurrent_state.shape)}")
        if recurrent_state.dtype != torch.float32:
            raise TypeError(f"recurrent_state must be float32, got {recurrent_state.dtype}")

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                recurrent_state: torch.Tensor, split: Callable | None = None) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; reads and writes the state slots named in `batch` in place.
        `split` (a forward captured in pieces, `nvl72.engine.prefill_graphs`): the per-sequence part,
        `mix`, is handed to it with `mix`'s arguments instead of run here (the projections before and the
        norm and out_proj after depend on the token count alone)."""
        self._check(hidden, conv_state, recurrent_state)
        mixed_qkv, z, b, a = self._project(hidden)
        g, beta = gdn_gating(self.A_log, a, self.dt_bias, b)
        if split is None:
            core = self.mix(mixed_qkv, g, beta, batch, conv_state, recurrent_state)
        else:
            core = split(self.mix, mixed_qkv, g, beta, batch, conv_state, recurrent_state)
        out = self.norm(core, z).reshape(hidden.shape[0], self.value_dim)  # [T, Hv*Dv]
        return self.out_proj(out)

    def mix(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch,
            conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> torch.Tensor:
        """The sequence mixing: causal conv of the projected q | k | v from each sequence's conv state,
        then the gated delta rule from its recurrent state (both written back through the batch's
        slots) -> [T, Hv, Dv]. g, beta [T, Hv]: `gdn_gating` of the projections' a and b."""
        T = mixed_qkv.shape[0]
        self._check_slots(batch, T)
        qsl, read, write = batch.query_start_loc, batch.state_read_slots, batch.state_write_slots
        ops = gdn_ops_for(mixed_qkv.device.type)
        mixed_qkv = ops.causal_conv1d(mixed_qkv, self.conv1d.weight.squeeze(1), conv_state, qsl, read, write)
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)  # [T, Hk, Dk]
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]

        B = read.shape[0]
        max_len = batch.max_query_len
        if max_len is None:
            max_len = int(batch.query_lens().max()) if B else 0
        if max_len <= self.RECURRENT_MAX_TOKENS:  # decode / verify: one call, no host data needed
            return ops.recurrent(q, k, v, g, beta, recurrent_state, qsl, read, write)  # [T, Hv, Dv]
        starts = qsl.tolist()
        long = [i for i in range(B) if starts[i + 1] - starts[i] > self.RECURRENT_MAX_TOKENS]
        short = sorted(set(range(B)) - set(long))
        core = torch.empty_like(v)  # [T, Hv, Dv]
        chunked = functools.partial(ops.chunked, chunk_size=self.CHUNK_SIZE)
        for seqs, fn in ((short, ops.recurrent), (long, chunked)):
            if len(seqs) == B:
                core = fn(q, k, v, g, beta, recurrent_state, qsl, read, write)
            elif seqs:
                rows, sub_qsl = self._rows(starts, seqs, mixed_qkv.device)
                core[rows] = fn(q[rows], k[rows], v[rows], g[rows], beta[rows], recurrent_state, sub_qsl,
                                read[seqs], write[rows])
        return core

    def mix_packed(self, proj: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                   recurrent_state: torch.Tensor) -> torch.Tensor:
        """What `forward` does between its projections and out_proj, for sequences of at most
        RECURRENT_MAX_TOKENS tokens, in one kernel (`gdn_triton.fused_recurrent_mix`: a decode layer's
        cat, gating, conv, delta rule and gated norm were ~20 launches). proj [T, rows of
        `packed_in_proj`] (the projections of the normed input) -> [T, Hv*Dv], out_proj's input."""
        from nvl72.model import gdn_triton

        self._check_slots(batch, proj.shape[0])  # the kernel's wrapper checks the states
        return gdn_triton.fused_recurrent_mix(
            *self._packed_views(proj), self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias, self.norm.weight,
            self.norm.eps, conv_state, recurrent_state, batch.query_start_loc, batch.state_read_slots,
            batch.state_write_slots)

    def _packed_views(self, proj: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k [T, Hk, Dk], v, z [T, Hk, r, Dv], b, a [T, Hk, r]: views into the packed projections' output
        in either checkpoint layout (`_project` says which)."""
        rows = sum(lin.out_features for lin in self.packed_in_proj.linears)
        if proj.dim() != 2 or proj.shape[1] != rows:
            raise ValueError(f"proj must be [T, {rows}] (packed_in_proj's rows), got {tuple(proj.shape)}")
        Hk, Dk, Dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // Hk
        if self.fused_qkvz:  # per key head [q, k, v (r heads), z (r heads)], then per key head [b (r), a (r)]
            group = 2 * Dk + 2 * r * Dv
            qkvz = proj[:, : Hk * group].unflatten(1, (Hk, group))
            ba = proj[:, Hk * group :].unflatten(1, (Hk, 2 * r))
            v, z = (qkvz[..., 2 * Dk + i * r * Dv : 2 * Dk + (i + 1) * r * Dv].unflatten(-1, (r, Dv)) for i in (0, 1))
            return qkvz[..., :Dk], qkvz[..., Dk : 2 * Dk], v, z, ba[..., :r], ba[..., r:]
        kd, vd, hv = self.key_dim, self.value_dim, self.num_v_heads  # [q | k | v | z | b | a]
        cuts = (0, kd, 2 * kd, 2 * kd + vd, 2 * kd + 2 * vd, 2 * kd + 2 * vd + hv, 2 * kd + 2 * vd + 2 * hv)
        q, k, v, z, b, a = (proj[:, lo:hi] for lo, hi in zip(cuts, cuts[1:]))
        return (q.unflatten(1, (Hk, Dk)), k.unflatten(1, (Hk, Dk)), v.unflatten(1, (Hk, r, Dv)),
                z.unflatten(1, (Hk, r, Dv)), b.unflatten(1, (Hk, r)), a.unflatten(1, (Hk, r)))

    def _check_slots(self, batch: ForwardBatch, T: int) -> None:
        if batch.state_read_slots is None or batch.state_write_slots is None:
            raise ValueError(f"GatedDeltaNet layer {self.layer_idx} needs state_read_slots and "
                             "state_write_slots in the ForwardBatch, got None")
        B = batch.query_start_loc.shape[0] - 1
        if batch.state_write_slots.shape != (T,) or batch.state_read_slots.shape != (B,):
            raise ValueError(f"state_write_slots must be [{T}] and state_read_slots [{B}], got "
                             f"{tuple(batch.state_write_slots.shape)} and {tuple(batch.state_read_slots.shape)}")

    @staticmethod
    def _rows(starts: list[int], seqs: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows of the chosen sequences [T'] and their cumulative lengths [N'+1]."""
        rows = [t for i in seqs for t in range(starts[i], starts[i + 1])]
        lens = [starts[i + 1] - starts[i] for i in seqs]
        cu = torch.tensor([0] + lens, device=device).cumsum(0)
        return torch.tensor(rows, dtype=torch.long, device=device), cu
