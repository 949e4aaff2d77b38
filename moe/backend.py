"""Expert-compute backends for moe.MoE, chosen once by capability and logged.

  reference        pure torch, the layer's dtype (bf16), a loop over experts     CPU default
  mxfp8-emulated   the FP8 pipeline below, run through the torch references      CPU (tests)
  sm90-fp8         Triton route/permute/quant + CuTeDSL wgmma grouped GEMMs      sm_90 + kernel module
                   ($NVL72_MOE_SM90_KERNELS=ws: the warp-specialized persistent FP8 GEMMs)
  torch-grouped    torch._grouped_mm (bf16) with torch permutation               other CUDA GPUs

The FP8 pipeline (one pass per MoE layer):
  permute (contiguous for prefill, masked [E, cap = T rounded up to 32] for decode, one kernel on
  GPU) -> gather + quantize x (1 x 128 power-of-two scales) -> grouped GEMM with w13 ->
  SiLU-and-mul + quantize (routed rows only) -> grouped GEMM with w2 -> weighted un-permute,
  adding sigmoid(x . w_gate) * shared(x) in the same kernel.
With 1 <= T <= $NVL72_MOE_FUSED_DECODE_TOKENS (default FUSED_DECODE_TOKENS; 0 turns it off) an ops set
with a `fused_decode` op (sm90-fp8: moe.kernels.triton_fused_decode) runs two kernels instead: gate/up +
SiLU per (token, expert) pair and down + weighted combine (+ the gated shared expert) per token, reading
the FP8 weights directly -- at one to a few tokens the pipeline's launches and dependencies cost more
than the active experts' bytes. At one token sm90-fp8 runs the CuTeDSL gate/up and (without a shared
expert) down of moe.kernels.sm90_one_token instead of Triton's (moe.fused_decode). The reference ops have no
`fused_decode` op, so mxfp8-emulated is unchanged.
Weights are converted once (`prepare`): MXFP8 (1 x 32, E8M0) then regrouped exactly into 128 x 128
power-of-two blocks for Hopper (moe.mxfp8). A backend that cannot run raises at selection time,
never in the hot path.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from aot.launch import pdl_enabled
from moe import mxfp8, reference
from moe.routing import permute_contiguous, permute_masked

log = logging.getLogger("moe.backend")
TILE_M = 128
DECODE_MAX_TOKENS = 256  # at or below this many tokens the masked (no host sync) layout is used
# Rows per expert of the masked layout are T rounded up to this: the token tile of the swap-AB
# decode GEMMs (the FP8 defaults). The SiLU-quant kernel works on routed rows only, but the GEMMs'
# grids and the h / y buffers scale with the capacity, so it follows T, not a 128-row M tile.
DECODE_ALIGN = 32
# at or below this many tokens an ops set with `fused_decode` runs it instead of the pipeline: one token.
# perf/RESULTS.md: per layer (tests/moe/gpu_fused_decode.sh, route included) 25.9-26.4 us against the
# pipeline's 29.5-30.1 on an H100 (2026-11-28; 24.9 against 25.2 on an H200, 2026-11-22), the engine's
# batch-1 step 0.713 against 0.741 ms (H100, 28 runs each); at T=2 46.3 against 45.8 us, so two tokens
# stay on the pipeline
FUSED_DECODE_TOKENS = 1
ENV_FUSED_DECODE_TOKENS = "NVL72_MOE_FUSED_DECODE_TOKENS"


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (wrong device, missing kernel module)."""


@dataclass
class ExpertWeights:
    """Per-backend converted weights of one MoE layer (rank-local experts)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


SM90_MODULE = "moe.kernels.sm90_grouped_gemm"
SM90_KERNEL_SETS = ("auto", "classic", "ws")
SM90_WS_MODULE = "moe.kernels.sm90_grouped_gemm_ws"  # warp-specialized persistent FP8 variants ("ws_*")
ENV_SM90_KERNELS = "NVL72_MOE_SM90_KERNELS"  # "auto" (default; = "ws"), "classic" or "ws": Sm90Gemm's FP8 defaults
# the clusters the cluster GEMM variants launch, instead of the driver's co-resident count (measurements)
ENV_MAX_CLUSTERS = "NVL72_MOE_MAX_CLUSTERS"
# a ws masked variant for the few-token calls instead of Sm90Gemm.SMALL_CAP_VARIANT ("" turns it off)
ENV_SMALL_CAP_VARIANT = "NVL72_MOE_SMALL_CAP_VARIANT"
# the contiguous (prefill) FP8 ws variant instead of Sm90Gemm.CONTIG_TABLE: "VARIANT" (both GEMMs) or
# "w13=VARIANT,w2=VARIANT" (a GEMM left out keeps the table; "" = the table)
ENV_CONTIG_VARIANT = "NVL72_MOE_CONTIG_VARIANT"
GEMM_ROLES = ("w13", "w2")


def load_sm90_module(module: str = SM90_MODULE):
    """A compiled CuTeDSL grouped-GEMM module: from the aot bundle (`nvl72 kernels build`), else
    JIT-compiled in-process (development path); the source is logged."""
    import aot

    try:
        mod = aot.load(module, "sm_90a")
        log.info("moe: %s from the aot bundle", module)
        return mod
    except (aot.BundleError, OSError) as e:
        log.info("moe: no aot bundle for %s (%s)", module, e)
    try:
        import importlib

        kernels = importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailable(f"no kernel bundle for {module} and CuTeDSL is not importable: {e}") from e
    log.warning("moe: JIT-compiling %s (development path)", module)
    return SimpleNamespace(**kernels.compile_for_export("sm_90a"))


class Sm90Gemm:
    """Torch-facing wrapper of the CuTeDSL variants (views as the kernel module documents).

    Defaults, from perf/RESULTS.md (H200): prefill (contiguous) FP8 uses the serial-promotion
    kernel (faster than the overlapped one at 10 of the 12 measured sizes of 512..16384 tokens, by
    up to 4%), decode (masked) FP8 the swap-AB kernel (8-16% faster than the 128-row masked one
    at 16..256 tokens, 10-17% slower at 1-2 tokens); `variant=` names another export of
    moe.kernels.sm90_grouped_gemm, or a "ws_*" export of moe.kernels.sm90_grouped_gemm_ws (needs
    `ws_module`). kernels="ws" (or "auto", the backend's default: the set measured fastest) makes the
    warp-specialized persistent FP8 kernels the defaults: on the H200 (perf/RESULTS.md, 2026-11-22) the
    contiguous one took 0.54-0.65x the serial kernel's time from 1024 to 16384 tokens, and the masked
    compact-walk one (`_cpo`) 0.60-0.78x the swap-AB kernel's at 1-256 tokens (74% of copy bandwidth
    at 128 tokens against 58%). A contiguous FP8 call that names its GEMM (role="w13" / "w2", as the
    FP8 pipeline does) takes its ws variant from CONTIG_TABLE by rows ($NVL72_MOE_CONTIG_VARIANT
    overrides it)."""

    DEFAULTS = {
        (True, False): "grouped_gemm_fp8_contig_serial",
        (True, True): "grouped_gemm_fp8_masked_swapab",
        (False, False): "grouped_gemm_bf16_contig",
        (False, True): "grouped_gemm_bf16_masked",
    }
    # masked default: staged scales (measured fastest at 1..128 tokens, 85% of copy bandwidth at 128 on an
    # H200, perf/RESULTS.md); past its K limit the same kernel without staging
    WS_DEFAULTS = {(True, False): "ws_fp8_contig", (True, True): "ws_fp8_masked_swapab_cps"}
    STAGED_FALLBACK = "ws_fp8_masked_swapab_cpo"
    # rows of A per CTA tile of the masked variants (the capacity must be a multiple: the kernels
    # index the a_scale rows of a tile without bounds checks)
    MASKED_ROW_TILE = {
        "grouped_gemm_fp8_masked_swapab": 32,
        "ws_fp8_masked_swapab": 32,
        "ws_fp8_masked_swapab_m64n16": 16,
        "ws_fp8_masked_swapab_cp": 32,
        "ws_fp8_masked_swapab_cpo": 32,
        "ws_fp8_masked_swapab_cpo_kg2": 32,
        "ws_fp8_masked_swapab_cpo_kg4": 32,
        "ws_fp8_masked_swapab_m64n32_cp": 32,
        "ws_fp8_masked_swapab_m64n16_cp": 16,
        "ws_fp8_masked_swapab_cps": 32,
        "ws_fp8_masked_swapab_m64n32_cps": 32,
        "ws_fp8_masked_swapab_m64n16_cps": 16,
    }
    WS_MASKED = [v for v in MASKED_ROW_TILE if v.startswith("ws_")]  # every warp-specialized decode variant
    # every contiguous one tiles rows by TILE_M (the padding of permute_contiguous); the ping-pong
    # variants' CTA tile is 128 x 256 (two 128-column halves, an odd last half left unstored;
    # _n256 without the warpgroups' issue turns, _e4 with 4 epilogue buffers, _mc on 2-CTA clusters
    # sharing the B tile through TMA multicast, _mc_e2 the same with 2 epilogue buffers, _sp with each
    # K step's scales loaded one step ahead, _mc_e2_sp both)
    WS_CONTIG = [
        "ws_fp8_contig", "ws_fp8_contig_serial", "ws_fp8_contig_pingpong", "ws_fp8_contig_n256",
        "ws_fp8_contig_n256_e4", "ws_fp8_contig_n256_mc", "ws_fp8_contig_n256_mc_e2", "ws_fp8_contig_n256_sp",
        "ws_fp8_contig_n256_mc_e2_sp",
    ]
    # variants launched in clusters: (CTAs per cluster, threads per CTA); they take one more argument
    # after aux, the count of clusters to launch (the device's co-resident ones, moe.occupancy)
    CLUSTERED = {v: (2, 384) for v in ("ws_fp8_contig_n256_mc", "ws_fp8_contig_n256_mc_e2", "ws_fp8_contig_n256_mc_e2_sp")}
    # masked variants with the compact tile walk: their shared prefix array holds this many experts
    # (moe.kernels.sm90_grouped_gemm_ws.MAX_EXPERTS)
    COMPACT_MAX_EXPERTS = {
        "ws_fp8_masked_swapab_cp": 1024,
        "ws_fp8_masked_swapab_cpo": 1024,
        "ws_fp8_masked_swapab_cpo_kg2": 1024,
        "ws_fp8_masked_swapab_cpo_kg4": 1024,
        "ws_fp8_masked_swapab_m64n32_cp": 1024,
        "ws_fp8_masked_swapab_m64n16_cp": 1024,
        "ws_fp8_masked_swapab_cps": 1024,
        "ws_fp8_masked_swapab_m64n32_cps": 1024,
        "ws_fp8_masked_swapab_m64n16_cps": 1024,
    }
    # variants that stage a tile's promotion factors in shared memory: the largest K they take
    # (128 * moe.kernels.sm90_grouped_gemm_ws.MAX_SCALE_K_TILES)
    STAGED_MAX_K = {
        "ws_fp8_masked_swapab_cps": 8192,
        "ws_fp8_masked_swapab_m64n32_cps": 8192,
        "ws_fp8_masked_swapab_m64n16_cps": 8192,
    }
    # few-token routing of the FP8 masked default (kernels "ws"/"auto"): a masked call whose capacity
    # (T rounded up to DECODE_ALIGN) is at most SMALL_CAP_MAX runs SMALL_CAP_VARIANT instead. Off (None)
    # until perf.moe shows the staged-scales kernel faster at 1-8 tokens on the GPU;
    # $NVL72_MOE_SMALL_CAP_VARIANT overrides it per process (A/B in the engine).
    SMALL_CAP_VARIANT: str | None = None
    SMALL_CAP_MAX = 32
    # contiguous FP8 (kernels "ws"/"auto", calls that name their GEMM: role "w13" or "w2"): the variant
    # by rows of A, ((fewest rows, variant), ...) largest first. Source: perf/RESULTS.md, "moe: expert
    # grouped GEMMs", 2026-11-22T05:45Z (H200, tests/moe/gpu_prefill_sweep.sh, each GEMM and w13 + w2
    # timed): at 16384 tokens (Qwen3-235B 131K rows, Qwen3.5-397B 164K) n256_mc_e2_sp 5.30 / 5.66 ms
    # (the other 128 x 256 variants 5.47-5.90 / 5.49-5.66); at 4096 (32K / 41K rows) n256_mc fastest for
    # both models and both GEMMs; below 4096 tokens the 128 x 128 contig kernel (fastest measured at 1024,
    # 01:21Z). Thresholds halfway (in log rows) between measured sizes; w13 and w2 have the same winner
    # family at every measured size, so both roles share the entries.
    CONTIG_TABLE = {
        role: ((98304, "ws_fp8_contig_n256_mc_e2_sp"), (24576, "ws_fp8_contig_n256_mc"), (0, "ws_fp8_contig"))
        for role in GEMM_ROLES
    }

    def __init__(self, module, ws_module=None, kernels: str = "classic"):
        if kernels not in SM90_KERNEL_SETS:
            raise ValueError(f"kernels={kernels!r}: expected one of {SM90_KERNEL_SETS}")
        if kernels != "classic" and ws_module is None:
            raise ValueError(f"kernels={kernels!r} needs the module {SM90_WS_MODULE} (ws_module=None)")
        self.mod, self.ws, self.kernels = module, ws_module, kernels
        self.defaults = self.DEFAULTS if kernels == "classic" else {**self.DEFAULTS, **self.WS_DEFAULTS}
        self._one = {}
        self._clusters = {}
        env = os.environ.get(ENV_MAX_CLUSTERS)
        self.max_clusters = int(env) if env else None
        if self.max_clusters is not None and self.max_clusters < 1:
            raise ValueError(f"${ENV_MAX_CLUSTERS}={env!r}: need a positive cluster count")
        small = os.environ.get(ENV_SMALL_CAP_VARIANT, self.SMALL_CAP_VARIANT)
        self.small_cap_variant = small or None
        if self.small_cap_variant is not None and self.small_cap_variant not in self.WS_MASKED:
            raise ValueError(f"small-cap variant {small!r} (${ENV_SMALL_CAP_VARIANT}): expected one of {self.WS_MASKED}")
        self.contig_table = contig_table(os.environ.get(ENV_CONTIG_VARIANT, ""), self.CONTIG_TABLE, self.WS_CONTIG)
        if kernels != "classic":
            log.info("moe: contiguous FP8 GEMM per role (min rows: variant): %s", "; ".join(
                f"{r} " + ", ".join(f"{m}: {v}" for m, v in t) for r, t in self.contig_table.items()))

    def contig_variant(self, role: str, rows: int) -> str:
        """The table's contiguous FP8 ws variant for GEMM `role` ("w13" or "w2") on `rows` rows of A."""
        if role not in self.contig_table:
            raise ValueError(f"role={role!r}: expected one of {GEMM_ROLES}")
        return next(v for m, v in self.contig_table[role] if rows >= m)

    def clusters(self, device: torch.device, variant: str) -> int:
        """Clusters to launch for a CLUSTERED variant on `device`: the co-resident count the driver
        reports (once per device), or ${ENV_MAX_CLUSTERS} if set, never more than SMs / cluster size."""
        size, threads = self.CLUSTERED[variant]
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = (idx, variant)
        if key not in self._clusters:
            from moe.occupancy import max_active_clusters

            sms = torch.cuda.get_device_properties(idx).multi_processor_count
            n = max_active_clusters(idx, size, threads, sms)
            if self.max_clusters is not None:
                n = min(self.max_clusters, sms // size)
                log.info("moe: %s on cuda:%d: %d clusters (%s)", variant, idx, n, ENV_MAX_CLUSTERS)
            self._clusters[key] = n
        return self._clusters[key]

    def kernel(self, variant: str):
        """The compiled export named `variant` ("ws_*" from the warp-specialized module)."""
        if not variant.startswith("ws_"):
            return getattr(self.mod, variant)
        if self.ws is None:
            raise ValueError(f"variant {variant!r} needs {SM90_WS_MODULE}, which this Sm90Gemm was built without")
        return getattr(self.ws, variant)

    def _dummy(self, device):
        if device not in self._one:
            self._one[device] = torch.ones(1, 1, 1, dtype=torch.float32, device=device)
        return self._one[device]

    def __call__(self, a, b, out, a_scale, b_scale, aux, masked, tile_m=TILE_M, variant=None, role=None):
        """role ("w13" / "w2", or None): picks the contiguous FP8 ws variant from contig_table when
        `variant` is None (None: the fixed default)."""
        if out.numel() == 0:
            return out
        fp8 = a.dtype == torch.float8_e4m3fn
        if fp8:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
            sa, sb = a_scale.permute(2, 1, 0), b_scale.permute(1, 2, 0)  # (rows, K/128, L), (N/128, K/128, E)
        else:
            sa = sb = self._dummy(a.device)
        if masked:
            a3, c3 = a.permute(1, 2, 0), out.permute(1, 2, 0)  # (cap, K, E), (cap, N, E)
        else:
            m = a.shape[0]
            a3, c3 = a.view(1, m, -1).permute(1, 2, 0), out.view(1, m, -1).permute(1, 2, 0)  # (M, K, 1)
        if variant is None and fp8 and masked and self.kernels != "classic" and self.small_cap_variant is not None:
            if a.shape[1] <= self.SMALL_CAP_MAX:
                variant = self.small_cap_variant
        if variant is None and fp8 and not masked and self.kernels != "classic" and role is not None:
            variant = self.contig_variant(role, a.shape[0])
        if variant is None:
            variant = self.defaults[(fp8, masked)]
            if a.shape[-1] > self.STAGED_MAX_K.get(variant, a.shape[-1]):
                variant = self.STAGED_FALLBACK
        if masked and a.shape[1] % self.MASKED_ROW_TILE.get(variant, TILE_M):
            raise ValueError(
                f"capacity {a.shape[1]} is not a multiple of {variant}'s row tile "
                f"{self.MASKED_ROW_TILE.get(variant, TILE_M)}"
            )
        if masked and a.shape[0] > self.COMPACT_MAX_EXPERTS.get(variant, a.shape[0]):
            raise ValueError(f"{a.shape[0]} experts: {variant} takes at most {self.COMPACT_MAX_EXPERTS[variant]}")
        if a.shape[-1] > self.STAGED_MAX_K.get(variant, a.shape[-1]):
            raise ValueError(f"K={a.shape[-1]}: {variant} takes K <= {self.STAGED_MAX_K[variant]}")
        fn = self.kernel(variant)
        args = (a3, b.permute(1, 2, 0), c3, sa, sb, aux.to(torch.int32))
        if variant in self.CLUSTERED:
            args += (self.clusters(a.device, variant),)
        fn(*args, int(pdl_enabled(a.device)))
        return out


def contig_table(spec: str, table: dict, known: list[str]) -> dict:
    """Sm90Gemm's per-GEMM contiguous table with ${ENV_CONTIG_VARIANT} applied: "VARIANT" for both
    GEMMs at every size, "w13=VARIANT,w2=VARIANT" per GEMM (one left out keeps `table`), "" = `table`."""
    out = dict(table)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        role, _, name = part.rpartition("=")
        roles = [role] if role else list(GEMM_ROLES)
        if role and role not in GEMM_ROLES or name not in known:
            raise ValueError(f"${ENV_CONTIG_VARIANT}={spec!r}: {part!r} needs [w13=|w2=] and one of {known}")
        for r in roles:
            out[r] = ((0, name),)
    return out


class ExpertBackend:
    """Base: `prepare` converts weights once, `run` computes this rank's expert contribution."""

    name = "base"

    def prepare(self, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        return ExpertWeights(w13, w2)

    def route(self, router_logits, top_k, renormalize, num_shared=0):
        return reference.route(router_logits, top_k, renormalize, num_shared)

    def run(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        weights: ExpertWeights,
        expert_offset: int,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        shared_ready: torch.cuda.Event | None = None,
    ) -> torch.Tensor:
        """x [T, H], topk_* [T, k] -> [T, H]: this rank's experts, plus the gated shared expert if
        given (after waiting on `shared_ready`, the event of the stream that computed it)."""
        raise NotImplementedError


class ReferenceBackend(ExpertBackend):
    name = "reference"

    def run(self, x, topk_weights, topk_ids, weights, expert_offset, shared=None, shared_gate=None, shared_ready=None):
        out = reference.experts(x, topk_weights, topk_ids, weights.w13, weights.w2, expert_offset)
        if shared is not None:
            out = out + torch.sigmoid(shared_gate) * shared
        return out


def fused_decode_threshold(value: int | None = None) -> int:
    """The most tokens the fused decode path takes (0 = off, at most DECODE_MAX_TOKENS): `value`, or
    ${ENV_FUSED_DECODE_TOKENS}, or FUSED_DECODE_TOKENS."""
    spec = os.environ.get(ENV_FUSED_DECODE_TOKENS, str(FUSED_DECODE_TOKENS)) if value is None else str(value)
    n = int(spec) if spec.strip().isdigit() else -1
    if not 0 <= n <= DECODE_MAX_TOKENS:
        where = f"${ENV_FUSED_DECODE_TOKENS}={spec!r}" if value is None else f"fused_decode_tokens={value!r}"
        raise ValueError(f"{where}: expected a token count from 0 (off) to {DECODE_MAX_TOKENS}")
    return n


class Fp8PipelineBackend(ExpertBackend):
    """The FP8 pipeline over a set of ops (references or kernels) with identical signatures; with a
    `fused_decode` op in the set, that op for 1 <= T <= fused_tokens (`fused_decode_tokens=None`: from
    ${ENV_FUSED_DECODE_TOKENS}, logged once here)."""

    def __init__(self, name: str, ops: SimpleNamespace, fused_decode_tokens: int | None = None):
        self.name, self.ops = name, ops
        self.fused_tokens = 0
        if hasattr(ops, "fused_decode"):
            self.fused_tokens = fused_decode_threshold(fused_decode_tokens)
            log.info("moe: %s: fused decode path at 1..%d tokens ($%s, 0 = off)", name, self.fused_tokens,
                     ENV_FUSED_DECODE_TOKENS)

    def route(self, router_logits, top_k, renormalize, num_shared=0):
        return self.ops.route(router_logits, top_k, renormalize, num_shared)

    def prepare(self, w13, w2):
        for nm, w in (("w13", w13), ("w2", w2)):
            if w.shape[1] % 128 or w.shape[2] % 128:
                raise ValueError(f"{nm}.shape={tuple(w.shape)}: the FP8 path needs N and K multiples of 128")
        c13, c2 = mxfp8.quantize_experts(w13.detach()), mxfp8.quantize_experts(w2.detach())
        return ExpertWeights(c13["q_sm90"], c2["q_sm90"], c13["scale_sm90"], c2["scale_sm90"])

    def run(self, x, topk_weights, topk_ids, weights, expert_offset, shared=None, shared_gate=None, shared_ready=None):
        ops = self.ops
        num_local, two_i, hidden = weights.w13.shape
        t = x.shape[0]
        if 1 <= t <= self.fused_tokens:
            return ops.fused_decode(x, topk_weights, topk_ids, weights.w13, weights.w13_scale, weights.w2,
                                    weights.w2_scale, expert_offset, shared, shared_gate, shared_ready)
        masked = t <= DECODE_MAX_TOKENS
        if masked:
            cap = -(-t // DECODE_ALIGN) * DECODE_ALIGN  # an expert gets at most T pairs: no overflow
            perm = ops.permute_masked(topk_ids, num_local, cap, expert_offset)
            aux, rows_per_batch = perm.counts, cap
        else:
            perm = ops.permute_contiguous(topk_ids, num_local, expert_offset, TILE_M)
            aux, rows_per_batch = perm.tile_expert, max(perm.num_rows, 1)
        a, sa = ops.gather_quant(x, perm.row_of, perm.num_rows, rows_per_batch)
        shape = (num_local, cap) if masked else (perm.num_rows,)
        h = torch.empty(*shape, two_i, dtype=x.dtype, device=x.device)
        ops.grouped_gemm(a.view(*shape, hidden), weights.w13, h, sa, weights.w13_scale, aux, masked, role="w13")
        a2, sa2 = ops.silu_mul_quant(h.view(-1, two_i), rows_per_batch, perm.row_of)  # routed rows only
        y = torch.empty(*shape, hidden, dtype=x.dtype, device=x.device)
        ops.grouped_gemm(a2.view(*shape, two_i // 2), weights.w2, y, sa2, weights.w2_scale, aux, masked, role="w2")
        if shared_ready is not None:
            torch.cuda.current_stream(x.device).wait_event(shared_ready)
        return ops.unpermute(y.view(-1, hidden), perm.row_of, topk_weights, shared, shared_gate)


class TorchGroupedBackend(ExpertBackend):
    """bf16 through torch._grouped_mm: the path for CUDA GPUs without our kernels (e.g. sm_100 today)."""

    name = "torch-grouped"

    def run(self, x, topk_weights, topk_ids, weights, expert_offset, shared=None, shared_gate=None, shared_ready=None):
        num_local, two_i, hidden = weights.w13.shape
        perm = permute_contiguous(topk_ids, num_local, expert_offset, align=1)
        ends = torch.cumsum(perm.counts, 0).to(torch.int32)
        a = x[perm.token_of]  # [M, H]
        h = torch._grouped_mm(a, weights.w13.transpose(1, 2), offs=ends)
        h = torch.nn.functional.silu(h[:, : two_i // 2]) * h[:, two_i // 2 :]
        y = torch._grouped_mm(h, weights.w2.transpose(1, 2), offs=ends)
        if shared_ready is not None:
            torch.cuda.current_stream(x.device).wait_event(shared_ready)
        return reference.unpermute(y, perm.row_of, topk_weights, shared, shared_gate)


def _reference_ops() -> SimpleNamespace:
    return SimpleNamespace(
        route=reference.route,
        permute_masked=permute_masked,
        permute_contiguous=permute_contiguous,
        gather_quant=reference.gather_quant,
        silu_mul_quant=reference.silu_mul_quant,
        grouped_gemm=reference.grouped_gemm,
        unpermute=reference.unpermute,
    )


def _sm90_ops() -> SimpleNamespace:
    from moe import fused_decode
    from moe.kernels import triton_moe

    kernels = os.environ.get(ENV_SM90_KERNELS, "auto")
    if kernels not in SM90_KERNEL_SETS:
        raise ValueError(f"${ENV_SM90_KERNELS}={kernels!r}: expected one of {SM90_KERNEL_SETS}")
    ws = load_sm90_module(SM90_WS_MODULE) if kernels != "classic" else None
    gemm = Sm90Gemm(load_sm90_module(), ws, kernels)
    log.info("moe: sm90 FP8 grouped GEMM defaults: %s kernels", kernels)
    try:
        one_token = load_sm90_module(fused_decode.MODULE)
    except BackendUnavailable as e:
        log.info("moe: one-token decode keeps Triton's kernels (%s)", e)
        one_token = None
    return SimpleNamespace(
        route=triton_moe.route,
        permute_masked=triton_moe.permute_masked,
        permute_contiguous=triton_moe.permute_contiguous,
        gather_quant=triton_moe.gather_quant,
        silu_mul_quant=triton_moe.silu_mul_quant,
        grouped_gemm=gemm,
        unpermute=triton_moe.unpermute,
        fused_decode=fused_decode.FusedDecode(one_token),
    )


def _need_cuda(major: int | None = None) -> None:
    if not torch.cuda.is_available():
        raise BackendUnavailable("needs a CUDA device")
    cap = torch.cuda.get_device_capability()
    if major is not None and cap[0] != major:
        raise BackendUnavailable(f"needs sm_{major}x, device is sm_{cap[0]}{cap[1]}")


def _make_sm90():
    _need_cuda(9)
    return Fp8PipelineBackend("sm90-fp8", _sm90_ops())


def _make_torch_grouped():
    _need_cuda()
    return TorchGroupedBackend()


REGISTRY: dict[str, Callable[[], ExpertBackend]] = {
    "reference": ReferenceBackend,
    "mxfp8-emulated": lambda: Fp8PipelineBackend("mxfp8-emulated", _reference_ops()),
    "sm90-fp8": _make_sm90,
    "torch-grouped": _make_torch_grouped,
}
_chosen: dict[str, ExpertBackend] = {}


def select(device: torch.device | str | None, name: str | None = None, fp8_shape: bool = True) -> ExpertBackend:
    """The backend for `device` (or the named one / $NVL72_MOE_BACKEND), built once and logged.
    `fp8_shape` False (an expert's H or I not a multiple of 128, as in the embedded tiny model): the
    automatic choice on a GPU is the reference loop, which takes any shape."""
    name = name or os.environ.get("NVL72_MOE_BACKEND")
    if name is not None and name not in REGISTRY:
        raise ValueError(f"unknown MoE backend {name!r}; known: {sorted(REGISTRY)}")
    if name is None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type != "cuda" or not fp8_shape:
            name = "reference"
        else:
            name = "sm90-fp8" if torch.cuda.get_device_capability(dev)[0] == 9 else "torch-grouped"
    if name not in _chosen:
        _chosen[name] = REGISTRY[name]()
        log.info("MoE expert backend: %s (device %s)", name, device)
    return _chosen[name]
