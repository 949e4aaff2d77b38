"""Per-parameter weight loaders (the nano-vllm idea).

Every parameter of the model carries `param.weight_loader(param, loaded, **shard)`: the loading
loop only maps checkpoint keys to parameters and hands tensors over, so a later tensor/expert
parallel layout changes the loaders and the parameter shapes, never the loop.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class WeightLoadError(RuntimeError):
    """A checkpoint that does not fit the model: missing, unexpected or mis-shaped tensors."""


class LazyTensor:
    """A checkpoint tensor not read yet (a safetensors slice): its shape is known and indexing
    reads only the rows asked for, so an expert-parallel rank reads only its own experts."""

    def __init__(self, sl):
        self._slice = sl
        self.shape = tuple(sl.get_shape())

    def __getitem__(self, idx) -> torch.Tensor:
        return self._slice[idx]


Loaded = torch.Tensor | LazyTensor


def _copy(dst: torch.Tensor, src: Loaded, what: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise WeightLoadError(f"checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}{what}")
    with torch.no_grad():
        dst.copy_(src[:].to(dtype=dst.dtype))


def default_weight_loader(param: torch.Tensor, loaded: Loaded) -> None:
    """Whole-tensor copy with a shape check."""
    _copy(param.data, loaded, "")


def shard_loader(dim: int, segments: list[tuple[int, int]], full: int) -> Callable:
    """A loader for a tensor-parallel slice: the checkpoint tensor is `full` long along `dim`
    (other dims as the parameter's); this rank keeps the (start, length) `segments` of it,
    concatenated in order (one segment for a plain split; q | k | v segments for GDN's fused
    projections and conv). Only those rows/columns are read from a lazy checkpoint tensor."""
    segments = _merge(segments)

    def load(param: torch.Tensor, loaded: Loaded) -> None:
        want = list(param.shape)
        want[dim] = full
        if tuple(loaded.shape) != tuple(want):
            raise WeightLoadError(f"checkpoint shape {tuple(loaded.shape)} != model shape {tuple(want)} "
                                  f"(before the tensor-parallel split along dim {dim})")
        offset = 0
        for start, n in segments:
            idx = (slice(None),) * dim + (slice(start, start + n),)
            _copy(param.data.narrow(dim, offset, n), loaded[idx], f" (rows {start}:{start + n} of dim {dim})")
            offset += n

    load.full_dim = (dim, full)  # the unsliced shape, for init_dummy_weights
    return load


def _merge(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent segments as one read."""
    out: list[tuple[int, int]] = []
    for start, n in segments:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return out


def first_rank_loader(rank: int) -> Callable:
    """A loader for a row-parallel layer's bias: whole on TP rank 0, zero on the others, so the
    all-reduce adds it once."""

    def load(param: torch.Tensor, loaded: Loaded) -> None:
        if rank == 0:
            _copy(param.data, loaded, "")
            return
        if tuple(loaded.shape) != tuple(param.shape):
            raise WeightLoadError(f"checkpoint shape {tuple(loaded.shape)} != model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.data.zero_()

    return load


def expert_weight_loader(
    param: torch.Tensor, loaded: Loaded, *, expert_id: int | None = None, shard: str | None = None
) -> None:
    """Routed-expert loader for `w13` [E_local, 2I, H] (gate rows, then up rows) and `w2` [E_local, H, I].

    The parameter knows its slice: experts `[expert_offset, expert_offset + E_local)` of
    `num_experts`, intermediate rows `[inter_offset, inter_offset + I)` of `inter_full` (the
    tensor-parallel split of each expert; all of it without one).
    expert_id=None: `loaded` holds all experts ([E, 2I_full, H] `gate_up_proj` or [E, H, I_full]
    `down_proj`, the fused layout). Otherwise one expert's `gate`/`up` ([I_full, H]) or `down`
    ([H, I_full]) matrix; experts of other ranks are skipped."""
    offset, local = param.expert_offset, param.shape[0]
    i0, full = param.inter_offset, param.inter_full
    inter, hidden = (param.shape[1] // 2, param.shape[2]) if param.is_w13 else (param.shape[2], param.shape[1])
    if expert_id is None:
        total = param.num_experts
        want = (total, 2 * full, hidden) if param.is_w13 else (total, hidden, full)
        if tuple(loaded.shape) != want:
            raise WeightLoadError(f"checkpoint shape {tuple(loaded.shape)} != model shape {want}")
        experts = slice(offset, offset + local)
        if param.is_w13:
            _copy(param.data[:, :inter], loaded[experts, i0 : i0 + inter], " (gate rows)")
            _copy(param.data[:, inter:], loaded[experts, full + i0 : full + i0 + inter], " (up rows)")
        else:
            _copy(param.data, loaded[experts, :, i0 : i0 + inter], "")
        return
    if not offset <= expert_id < offset + local:
        return
    e = expert_id - offset
    if shard in ("gate", "up"):
        want, rows = (full, hidden), (slice(0, inter) if shard == "gate" else slice(inter, 2 * inter))
        if tuple(loaded.shape) != want:
            raise WeightLoadError(f"checkpoint shape {tuple(loaded.shape)} != model shape {want} "
                                  f"(expert {expert_id} {shard})")
        _copy(param.data[e, rows], loaded[i0 : i0 + inter], f" (expert {expert_id} {shard} rows of w13)")
    elif shard == "down":
        want = (hidden, full)
        if tuple(loaded.shape) != want:
            raise WeightLoadError(f"checkpoint shape {tuple(loaded.shape)} != model shape {want} "
                                  f"(expert {expert_id} down)")
        _copy(param.data[e], loaded[:, i0 : i0 + inter], f" (expert {expert_id} of w2)")
    else:
        raise WeightLoadError(f"unknown expert shard {shard!r}")


def attach_default_loaders(module: nn.Module) -> None:
    """Give every parameter without a loader the whole-tensor one."""
    for p in module.parameters():
        if not hasattr(p, "weight_loader"):
            p.weight_loader = default_weight_loader


class PackedRows:
    """Several projections of one input as one: their weights (and biases) stacked by rows in one tensor,
    so a step runs one GEMM (at batch 1 one GEMV launch) instead of one a projection. Calling it packs
    them the first time and makes the parameters views of the packed tensor, so loaders still write
    them in place; a later `.to()` that gives them their own storage again is noticed and packed anew.
    Not an nn.Module: the linears stay registered where they are."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._ptrs: tuple[int, ...] | None = None

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [sum of out_features, in_features], bias or None)."""
        if self._ptrs != self._param_ptrs():
            with torch.inference_mode(False), torch.no_grad():
                for name in ("weight", "bias"):
                    parts = [getattr(lin, name) for lin in self.linears]
                    if parts[0] is None:
                        continue
                    packed = torch.cat([p.detach() for p in parts])
                    setattr(self, name, packed)
                    start = 0
                    for p in parts:
                        p.data = packed[start : start + p.shape[0]]
                        start += p.shape[0]
            self._ptrs = self._param_ptrs()
        return self.weight, self.bias

    def _param_ptrs(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for lin in self.linears for p in lin.parameters())
