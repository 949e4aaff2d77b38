"""The MoE layer of a DP-attention + EP decode instance, through `comms.DispatchCombine`.

Each rank of the EP group owns its requests and full attention/dense/shared weights (TP = 1);
routed experts are split by id over the group. Per MoE layer every rank routes its own tokens,
`dispatch`es them to the experts' owners, runs its local experts on what it received, `combine`s
the weighted outputs back to the tokens' owners and adds its own (full) shared expert.

The dispatch/combine calls are collectives: every rank of the group makes them for every MoE layer
of every step, in the same order, also when it has no tokens (`idle_forward`). Ranks must agree on
what runs: a step with MTP drafts on one rank needs MTP drafts (or an idle MTP pass) on all;
`PassSync` matches the ranks' passes of one engine step when their counts differ.

The expert GEMMs run through the layer's backend on the contiguous packed rows (host-side counts:
not CUDA-graph capturable as written). Serving ranks on CUDA in bf16 dispatch and combine through
the fused NVLink kernels (`serving_dp_ep_layout`), elsewhere through the torch.distributed reference.
"""
from __future__ import annotations

import logging

import torch

from comms import DispatchCombine
from moe import MoE
from nvl72.config import ModelConfig
from nvl72.model.parallel_layout import ParallelLayout

log = logging.getLogger(__name__)


def dp_ep_layout(group, config: ModelConfig, max_tokens_per_rank: int, dtype: torch.dtype,
                 timeout_s: float = 10.0, heap=None) -> ParallelLayout:
    """The layout of one DP+EP decode rank: experts over `group` (this rank's place in it), TP 1,
    MoE layers through a contiguous-layout `DispatchCombine` sized for `max_tokens_per_rank`
    tokens per step (on `heap`, a `comms.SymmetricHeap`, for the fused kernels; else the
    torch.distributed reference over `group`)."""
    dc = DispatchCombine(group if heap is None else heap, config.num_experts, config.num_experts_per_tok,
                         config.hidden_size, max_tokens_per_rank, mode="dp_ep", dtype=dtype,
                         layout="contiguous", timeout_s=timeout_s)
    return ParallelLayout(ep_rank=dc.rank, ep_size=dc.world, dispatch=dc)


def serving_dp_ep_layout(group, config: ModelConfig, max_tokens_per_rank: int, dtype: torch.dtype, device: str,
                         timeout_s: float = 10.0) -> ParallelLayout:
    """dp_ep_layout with the fused NVLink dispatch/combine kernels where they apply: on CUDA in
    bf16, over a `comms.SymmetricHeap` of `group` (every rank takes the same branch: the conditions
    are the same on all of them). Where the kernels refuse the shape (hidden not a multiple of
    1024, a top-k without a compiled kernel, ...) or the bundle lacks them, the torch.distributed
    reference, with the reason logged; also on CPU and in fp32 (the kernels move bf16)."""
    if torch.device(device).type != "cuda" or dtype != torch.bfloat16:
        return dp_ep_layout(group, config, max_tokens_per_rank, dtype, timeout_s)
    import torch.distributed as dist

    from aot import BundleError
    from comms import SymmetricHeap

    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    nbytes = DispatchCombine.heap_size_hint(dist.get_world_size(group), config.num_experts,
                                            config.num_experts_per_tok, config.hidden_size, max_tokens_per_rank)
    heap = SymmetricHeap(group, nbytes, dev, timeout_s=timeout_s)
    try:
        return dp_ep_layout(group, config, max_tokens_per_rank, dtype, timeout_s, heap=heap)
    except (ValueError, BundleError) as e:
        log.warning("DP+EP dispatch/combine: the fused kernels do not apply (%s); torch.distributed reference", e)
        heap.destroy()
        return dp_ep_layout(group, config, max_tokens_per_rank, dtype, timeout_s)


def run_local_experts(mlp: MoE, recv) -> torch.Tensor:
    """Each received entry through its own local expert, unweighted (combine applies the router
    weights): recv.x [..., H] -> expert outputs shaped like recv.x (rows past a count are zero).

    The packed entries go through `MoE.run_experts` (the layer's backend) as single-slot tokens
    with weight 1, so the expert math is exactly the single-rank layer's."""
    hidden = recv.x.shape[-1]
    flat = recv.x.reshape(-1, hidden)  # [rows, H]
    out = torch.zeros_like(flat)
    counts = recv.counts.tolist()
    if sum(counts) == 0:
        return out.view_as(recv.x)
    starts = recv.offsets.tolist()
    rows = torch.cat([torch.arange(s, s + c, device=flat.device) for s, c in zip(starts, counts)])  # [M]
    experts = torch.repeat_interleave(torch.arange(len(counts), device=flat.device),
                                      torch.tensor(counts, device=flat.device)) + mlp.expert_offset
    ones = torch.ones(rows.numel(), 1, dtype=torch.float32, device=flat.device)
    out[rows] = mlp.run_experts(flat[rows], ones, experts[:, None])  # [M, H]
    return out.view_as(recv.x)


def moe_forward(mlp: MoE, x: torch.Tensor, dc: DispatchCombine) -> torch.Tensor:
    """x [T, H] (this rank's tokens; T may be 0) -> the full MoE output [T, H]: all routed experts
    (wherever they live) plus the shared expert. A collective over `dc`'s group."""
    topk_weights, topk_ids = mlp.route(x)  # [T, k] each
    recv, handle = dc.dispatch(x, topk_ids, topk_weights)
    out = dc.combine(run_local_experts(mlp, recv), handle)  # [T, H]
    shared = mlp.shared(x)
    return out if shared is None else out + shared


def _moe_layers(layers) -> list[MoE]:
    return [layer.mlp for layer in layers if isinstance(layer.mlp, MoE)]


@torch.no_grad()
def idle_forward(model, mtp_step: int | None = None) -> None:
    """Take part in one step's MoE collectives with zero tokens: every MoE layer of the decoder
    (or, with `mtp_step`, of the MTP layer that `forward_mtp(..., step=mtp_step)` runs), in
    order. Touches no cache; the other ranks' tokens still reach this rank's experts."""
    dc = model.parallel.dispatch
    if dc is None:
        raise ValueError(f"idle_forward needs a DP+EP layout (parallel.dispatch set), got {model.parallel}")
    if mtp_step is None:
        layers = model.model.layers
    else:
        if model.mtp is None:
            raise ValueError(f"mtp_step={mtp_step} but the model was built without its MTP head")
        layers = [model.mtp.layers[mtp_step % len(model.mtp.layers)]]
    hidden = model.config.hidden_size
    for mlp in _moe_layers(layers):
        moe_forward(mlp, torch.empty(0, hidden, dtype=model.dtype, device=model.device), dc)


MAIN_PASS = 0  # the decoder's pass; MTP pass `step` is 1 + step (`mtp_pass`)
_DONE = 1 << 30


def mtp_pass(step: int) -> int:
    """The pass kind of `forward_mtp(..., step=step)`."""
    return 1 + step


class PassSync:
    """Lockstep of the DP+EP ranks' model passes within one engine step.

    The ranks of a decode instance run different numbers of passes per step (one has only idle
    work, another MTP drafts, a third several chained drafts), but every pass is a collective. Each
    rank calls `before(kind)` ahead of each of its passes (kinds non-decreasing within a step) and
    `finish()` once at the end of every step, busy or not. Each round all ranks agree (all-reduce
    MIN) on the lowest pending kind; ranks with something else pending run that pass idle, so all
    run the same MoE layers in the same order. `finish` returns when no rank has a pass left.
    Costs one small all-reduce per pass and one per step."""

    def __init__(self, model, group, timeout: float, device: str | torch.device = "cpu"):
        if model.parallel.dispatch is None:
            raise ValueError(f"PassSync needs a DP+EP model (parallel.dispatch set), got {model.parallel}")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: must be positive seconds")
        self.model, self.group, self.timeout, self.device = model, group, timeout, device
        self._last = MAIN_PASS
        self.idle_passes = 0

    def _lowest(self, kind: int) -> int:
        import torch.distributed as dist

        from nvl72.parallel import wait

        t = torch.tensor([kind], dtype=torch.int64, device=self.device)
        wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True), self.timeout,
             "DP+EP pass agreement")
        return int(t)

    def _idle(self, kind: int) -> None:
        idle_forward(self.model, None if kind == MAIN_PASS else kind - 1)
        self.idle_passes += 1

    def before(self, kind: int) -> None:
        """Join the other ranks' lower passes idle until all are ready for a pass of `kind`."""
        if not MAIN_PASS <= kind < _DONE or kind < self._last:
            raise ValueError(f"pass kind {kind} after {self._last}: kinds are MAIN_PASS or mtp_pass(step), "
                             "non-decreasing within a step")
        self._last = kind
        while (k := self._lowest(kind)) != kind:
            self._idle(k)

    def finish(self) -> None:
        """End this rank's step: run the other ranks' remaining passes idle until all are done."""
        while (k := self._lowest(_DONE)) != _DONE:
            self._idle(k)
        self._last = MAIN_PASS
