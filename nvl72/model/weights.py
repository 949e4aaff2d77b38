"""Per-parameter weight loaders (the nano-vllm idea).

Every parameter of the model carries `param.weight_loader(param, loaded, **shard)`: the loading
loop only maps checkpoint keys to parameters and hands tensors over, so a later tensor/expert
parallel layout changes the loaders and the parameter shapes, never the loop.
"""
from __future__ import annotations

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


def expert_weight_loader(
    param: torch.Tensor, loaded: Loaded, *, expert_id: int | None = None, shard: str | None = None
) -> None:
    """Routed-expert loader for `w13` [E_local, 2I, H] (gate rows, then up rows) and `w2` [E_local, H, I].

    expert_id=None: `loaded` holds all experts ([E, 2I, H] `gate_up_proj` or [E, H, I] `down_proj`,
    the fused layout); this rank keeps `[expert_offset, expert_offset + E_local)`. Otherwise one
    expert's `gate`/`up` ([I, H]) or `down` ([H, I]) matrix; experts of other ranks are skipped."""
    offset, local = param.expert_offset, param.shape[0]
    if expert_id is None:
        total = param.num_experts
        if len(loaded.shape) != 3 or loaded.shape[0] != total:
            raise WeightLoadError(
                f"checkpoint shape {tuple(loaded.shape)} != model shape ({total}, {', '.join(map(str, param.shape[1:]))})"
            )
        _copy(param.data, loaded[offset : offset + local], "")
        return
    if not offset <= expert_id < offset + local:
        return
    e = expert_id - offset
    inter = param.shape[1] // 2
    if shard == "gate":
        _copy(param.data[e, :inter], loaded, f" (expert {expert_id} gate rows of w13)")
    elif shard == "up":
        _copy(param.data[e, inter:], loaded, f" (expert {expert_id} up rows of w13)")
    elif shard == "down":
        _copy(param.data[e], loaded, f" (expert {expert_id} of w2)")
    else:
        raise WeightLoadError(f"unknown expert shard {shard!r}")


def attach_default_loaders(module: nn.Module) -> None:
    """Give every parameter without a loader the whole-tensor one."""
    for p in module.parameters():
        if not hasattr(p, "weight_loader"):
            p.weight_loader = default_weight_loader
