"""`moe.MoE`: the one entry point the service calls for a mixture-of-experts layer.

Holds the router, this rank's slice of the routed experts (fused gate/up `w13` and `w2`) and an
optional shared expert behind a sigmoid gate (Qwen3-Next / Qwen3.5). Expert parallelism: a rank
owns experts `[expert_offset, expert_offset + num_local_experts)`; `forward` returns only the
contribution of those experts (plus the shared expert on rank 0 of the EP group, or on every rank
with `add_shared=True` when each holds a tensor-parallel slice of it), so the caller sums across
ranks (all-reduce in prefill, combine in decode).

The pieces (`route`, `run_experts`, `shared`) are public so that a dispatch/combine path can put
communication between routing and the expert GEMMs.

The compute runs on a backend from moe/backend.py, chosen once per layer from the weights' device
(or `backend=` / $NVL72_MOE_BACKEND) and logged; `prepare()` converts the expert weights for it
(FP8 on GPU) and must be called again if the weights are reloaded (the first call does it
otherwise). The shared expert is, where the layer holds all of it (no EP) and its intermediate size
is a multiple of the experts', held as `num_shared` more experts (`prepare`, $NVL72_MOE_FUSE_SHARED)
that every token picks with weight sigmoid(x . w_gate): its gate logit is one more row of the router,
its slices run in the same expert kernels (and format: FP8 on GPU) as the routed experts, so a decode
layer pays no launches of its own for it (the Qwen3-Next shape at batch 1 spent ~19 us a layer on the
shared expert's five cuBLAS and two elementwise kernels: perf/RESULTS.md). Otherwise it runs beside them, on
a second stream on CUDA, and `sigmoid(x . w_gate) * shared(x)` is added inside the un-permute kernel.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from moe import backend as backends

log = logging.getLogger("moe.layer")
ENV_FUSE_SHARED = "NVL72_MOE_FUSE_SHARED"  # "1" (default): the shared expert as experts where it can be; "0": beside


def shared_slots(shared_inter: int, inter: int, ep_size: int = 1) -> tuple[int, str | None]:
    """(experts a shared expert of intermediate `shared_inter` becomes, or 0; why not): all of it on
    this rank (no EP), a multiple m of the experts' intermediate `inter` (m slices), and
    ${ENV_FUSE_SHARED} not "0"."""
    flag = os.environ.get(ENV_FUSE_SHARED, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"${ENV_FUSE_SHARED}={flag!r}: expected 0 or 1")
    why = (f"${ENV_FUSE_SHARED}=0" if flag == "0" else f"EP size {ep_size}" if ep_size > 1
           else f"its intermediate {shared_inter} is not a multiple of the experts' {inter}"
           if shared_inter % inter else None)
    return (0, why) if why else (shared_inter // inter, None)


@functools.cache
def _log_once(msg: str) -> None:
    log.info(msg)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`, as in the checkpoints)."""

    def __init__(self, hidden: int, intermediate: int, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden, intermediate, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class MoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        *,
        norm_topk_prob: bool = True,
        shared_intermediate: int = 0,
        ep_rank: int = 0,
        ep_size: int = 1,
        add_shared: bool | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        backend: str | None = None,
    ):
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.intermediate = intermediate
        self.norm_topk_prob = norm_topk_prob
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_offset = ep_rank * self.num_local_experts
        # whether forward adds this rank's shared expert (default: EP rank 0 holds all of it)
        self.add_shared = ep_rank == 0 if add_shared is None else add_shared
        kw = dict(dtype=dtype, device=device)
        self.gate = nn.Linear(hidden, num_experts, bias=False, **kw)  # router
        # [E_local, 2I, H]: rows [0, I) are gate_proj, rows [I, 2I) are up_proj
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate, hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden, intermediate, **kw))
        if shared_intermediate:
            self.shared_expert = SharedExpert(hidden, shared_intermediate, **kw)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, **kw)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.backend_name = backend
        self._backend: backends.ExpertBackend | None = None
        self._weights: backends.ExpertWeights | None = None
        self._side_stream = None
        self.masters_released = False  # see prepare
        self.num_shared = 0  # experts past the routed ones holding the shared expert (set by prepare)
        self._router: torch.Tensor | None = None  # [E + 1, H] with num_shared: gate, then shared_expert_gate

    def prepare(self, release_masters: bool = False) -> "MoE":
        """Choose the backend (once) and convert the expert weights for it; call after loading.

        `release_masters`: where the backend made its own copy (FP8 and its scales), free the loaded
        w13 / w2 (the parameters become empty): nothing reads them again, and a bf16 Qwen3-30B-A3B
        holds 58 GB of them beside 29 GB of FP8, which does not fit one 80 GB GPU. Converting again
        after that needs the weights reloaded (prepare raises)."""
        if self.masters_released:
            raise RuntimeError("MoE.prepare: the expert weights were converted with release_masters=True "
                               "and their loaded copies freed; reload the model to convert them again")
        if self._backend is None:
            fp8_shape = self.hidden % 128 == 0 and self.intermediate % 128 == 0
            self._backend = backends.select(self.w13.device, self.backend_name, fp8_shape)
        self.num_shared = self._shared_slots()
        masters = [self.w13, self.w2]
        with torch.no_grad():
            w13, w2 = self.w13, self.w2
            if self.num_shared:
                w13, w2 = self._with_shared(w13, w2)
                self._pack_router()
                masters += [lin.weight for lin in (self.shared_expert.gate_proj, self.shared_expert.up_proj,
                                                   self.shared_expert.down_proj)]
            self._weights = self._backend.prepare(w13, w2)
        if release_masters and not any(_shares_storage(c, m) for c, m in ((self._weights.w13, self.w13),
                                                                           (self._weights.w2, self.w2))):
            for p in masters:
                p.data = p.data.new_empty((0,) * p.dim())
            self.masters_released = True
        return self

    def _shared_slots(self) -> int:
        """How many experts this layer's shared expert becomes (`shared_slots`; 0 when it has none here)."""
        if self.shared_expert is None or not self.add_shared:
            return 0
        n, why = shared_slots(self.shared_expert.gate_proj.out_features, self.intermediate, self.ep_size)
        _log_once(f"moe: shared expert {'beside the experts (' + why + ')' if why else 'held as experts'}")
        return n

    def _with_shared(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 [E, 2I, H] and w2 [E, H, I] with the shared expert's num_shared slices appended as experts
        (slice j: gate/up rows and down columns [j I, (j + 1) I): down is linear, so they sum to it)."""
        se, inter = self.shared_expert, self.intermediate
        gate, up, down = se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight
        sl = [slice(j * inter, (j + 1) * inter) for j in range(self.num_shared)]
        w13 = torch.cat([w13, torch.stack([torch.cat([gate[j], up[j]]) for j in sl])])
        w2 = torch.cat([w2, torch.stack([down[:, j] for j in sl])])
        return w13, w2

    def _pack_router(self) -> None:
        """The router and the shared expert's gate as one [E + 1, H] weight (one GEMV gives all the
        logits route needs); the parameters become views of it, so loaders still write them in place."""
        gate, sgate = self.gate.weight, self.shared_expert_gate.weight
        self._router = torch.cat([gate.detach(), sgate.detach()])
        gate.data, sgate.data = self._router[: self.num_experts], self._router[self.num_experts :]

    def router_weight(self) -> torch.Tensor:
        """The weight whose logits `route` takes: the gate's [E, H], or [E + 1, H] with the shared
        expert's gate when it is held as experts. Prepares the layer first (the choice is made there)."""
        self._ready()
        if not self.num_shared:
            return self.gate.weight
        if self.gate.weight.data_ptr() != self._router.data_ptr():  # given its own storage (`.to()`)
            self._pack_router()
        return self._router

    def _ready(self) -> backends.ExpertBackend:
        if self._weights is None:
            self.prepare()
        return self._backend

    def fp8_weights(self) -> backends.ExpertWeights | None:
        """The prepared expert weights when the backend keeps them in FP8 (e4m3 with fp32 128 x 128
        block scales: the sm90-fp8 and mxfp8-emulated backends), for kernels that read them
        directly; None for the other backends."""
        self._ready()
        w = self._weights
        return w if w.w13.dtype == torch.float8_e4m3fn and w.w13_scale is not None else None

    def backend_label(self) -> str:
        """The expert backend's name (after choosing it), for logs and errors."""
        return getattr(self._ready(), "name", type(self._backend).__name__)

    def route(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, k'] fp32, topk_ids [T, k'] int64), k' = top_k + num_shared (the
        shared expert's slots last). `router_logits` [T, rows of `router_weight()`]: its logits computed by
        the caller (the service folds them into its norm kernel)."""
        backend = self._ready()
        logits = F.linear(x, self.router_weight()) if router_logits is None else router_logits
        return backend.route(logits, self.top_k, self.norm_topk_prob, self.num_shared)

    def run_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        shared_ready: torch.cuda.Event | None = None,
    ) -> torch.Tensor:
        """Weighted sum over this rank's experts for replicated tokens: [T, H] -> [T, H].

        shared [T, H] and shared_gate [T, 1] (the raw gate logit), when given, are added as
        sigmoid(shared_gate) * shared in the same pass, after waiting on `shared_ready` (the
        event of the stream that computed them)."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x.shape={tuple(x.shape)}: expected [T, {self.hidden}]")
        backend = self._ready()
        w = self._weights
        return backend.run(x, topk_weights, topk_ids, w, self.expert_offset, shared, shared_gate, shared_ready)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """sigmoid(x . w_gate) * shared_expert(x), or None when the model has no shared expert."""
        if self.shared_expert is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _shared_parts(self, x: torch.Tensor):
        """(shared_expert(x), gate logit, ready event): on a side stream on CUDA (event set), inline
        elsewhere (event None); all None when this rank adds no shared expert."""
        if self.shared_expert is None or not self.add_shared or self.num_shared:
            return None, None, None
        if x.device.type != "cuda":
            return self.shared_expert(x), self.shared_expert_gate(x), None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=x.device)
        main = torch.cuda.current_stream(x.device)
        self._side_stream.wait_stream(main)
        with torch.cuda.stream(self._side_stream):
            s, g = self.shared_expert(x), self.shared_expert_gate(x)
            ready = torch.cuda.Event()
            ready.record()
        x.record_stream(self._side_stream)
        s.record_stream(main)
        g.record_stream(main)
        return s, g, ready

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The MoE of x [T, H]; `routing` (topk_weights, topk_ids) as `route` gives it, when the caller
        has it (the service computes it beside its norm kernel), else `route(x)`."""
        self._ready()  # decides num_shared
        s, g, ready = self._shared_parts(x)
        topk_weights, topk_ids = self.route(x) if routing is None else routing
        return self.run_experts(x, topk_weights, topk_ids, s, g, ready)
