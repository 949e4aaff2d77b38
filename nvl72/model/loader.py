"""Fill a built model from a Hugging Face checkpoint directory, or with dummy weights.

Checkpoint layouts handled:
- sharded (`model.safetensors.index.json`) or single-file safetensors;
- routed experts per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, Qwen3 / Qwen3-Next and
  what transformers 5's `save_pretrained` writes for all three families) or fused
  (`mlp.experts.gate_up_proj` [E, 2I, H] gate rows then up rows, `mlp.experts.down_proj` [E, H, I],
  the official Qwen3.5 layout);
- multimodal Qwen3.5 (`model.language_model.*`; `model.visual.*` skipped), `mtp.*` for the MTP head
  (skipped when the model was built without it).
Every model parameter must be covered exactly; anything else is a `WeightLoadError` naming the key.
Tensors are read lazily (safetensors slices): an expert-parallel rank reads only its experts' rows,
a tensor-parallel rank only its heads' / intermediate slice (each parameter's loader knows which).
"""
from __future__ import annotations

import json
import logging
import os
import re
import zlib
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from moe import MoE
from nvl72.config import ModelConfig
from nvl72.model.parallel_layout import ParallelLayout
from nvl72.model.qwen import QwenMoeForCausalLM, build_model
from nvl72.model.weights import LazyTensor, WeightLoadError

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_PER_EXPERT = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_SHARD = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_SKIP_PREFIXES = ("model.visual.", "visual.")


def load_model(
    path: str | os.PathLike | None,
    *,
    config: ModelConfig | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    load_format: str = "auto",
    enable_mtp: bool | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    parallel: ParallelLayout | None = None,
    seed: int = 0,
) -> QwenMoeForCausalLM:
    """Config from `path` (unless given), build, load. `load_format="dummy"` needs only a config.
    Under `parallel` each rank reads only its slices of the checkpoint (of the dummy weights: the
    same model in every layout, see init_dummy_weights)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {LOAD_FORMATS}")
    if config is None:
        if path is None:
            raise ValueError("load_model needs a checkpoint path or a config")
        config = ModelConfig.from_pretrained(path)
    model = build_model(config, dtype, device, enable_mtp=enable_mtp, ep_rank=ep_rank, ep_size=ep_size,
                        parallel=parallel)
    load_weights(model, path, load_format=load_format, seed=seed)
    return model


def prepare_experts(model: QwenMoeForCausalLM) -> int:
    """Convert every MoE layer's experts for its backend now (not on the first forward) and free the
    loaded copies the backend no longer reads (`moe.MoE.prepare(release_masters=True)`): what a
    serving engine does once its weights are loaded, before the KV cache takes the free memory.
    Returns the bytes freed."""
    freed = 0
    for m in model.modules():
        if isinstance(m, MoE) and not m.masters_released:
            size = sum(p.numel() * p.element_size() for p in (m.w13, m.w2))
            m.prepare(release_masters=True)
            freed += size if m.masters_released else 0
    if freed:
        log.info("experts converted; %.1f GiB of loaded expert weights freed", freed / 2**30)
    return freed


def load_weights(
    model: QwenMoeForCausalLM, path: str | os.PathLike | None, *, load_format: str = "auto", seed: int = 0, progress: bool = True
) -> None:
    """Fill every parameter of `model` from the checkpoint at `path` (or with dummy weights);
    raises WeightLoadError on a missing, unexpected or mis-shaped tensor."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {LOAD_FORMATS}")
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        return
    if path is None:
        raise ValueError(f"load_format={load_format!r} needs a checkpoint path")
    files = checkpoint_files(path)
    params = dict(model.named_parameters())
    filled: set = set()
    skipped = 0
    total = len(checkpoint_keys(path))
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for key, tensor in _iter_tensors(files):
            bar.update(1)
            target = _map_key(key, model)
            if target is None:
                skipped += 1
                continue
            name, kwargs, units = target
            param = params.get(name)
            if param is None:
                raise WeightLoadError(f"unexpected checkpoint key {key!r} (no model parameter {name!r})")
            try:
                param.weight_loader(param, tensor, **kwargs)
            except WeightLoadError as e:
                raise WeightLoadError(f"{key}: {e}") from None
            filled.update(units(param))
    missing = [u for u in _expected_units(params) if u not in filled]
    if missing:
        names = [_unit_key(u) for u in missing]
        more = f" (+{len(names) - 5} more)" if len(names) > 5 else ""
        raise WeightLoadError(f"checkpoint {os.fspath(path)!r} is missing {', '.join(map(repr, names[:5]))}{more}")
    log.info("loaded %d tensors from %s (%d skipped)", total - skipped, os.fspath(path), skipped)


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint directory (index first, else all *.safetensors)."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        raise WeightLoadError(f"checkpoint path {p!r} is not a directory")
    index = os.path.join(p, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(p) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no safetensors files in {p!r}")
    out = [os.path.join(p, f) for f in files]
    for f in out:
        if not os.path.exists(f):
            raise WeightLoadError(f"checkpoint shard {f!r} named in the index does not exist")
    return out


def checkpoint_keys(path: str | os.PathLike) -> list[str]:
    """All tensor names of a checkpoint (read from the safetensors headers)."""
    keys = []
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt") as sf:
            keys.extend(sf.keys())
    return keys


def _iter_tensors(files: list[str]) -> Iterator[tuple[str, LazyTensor]]:
    """(key, unread tensor): loaders read what they keep, skipped keys are never read."""
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for key in sf.keys():
                yield key, LazyTensor(sf.get_slice(key))


def _map_key(key: str, model: QwenMoeForCausalLM):
    """checkpoint key -> (param name, loader kwargs, units(param) -> coverage units) or None to skip."""
    if key.startswith(_SKIP_PREFIXES) or key.endswith("rotary_emb.inv_freq"):
        return None
    if key.startswith("model.language_model."):
        key = "model." + key[len("model.language_model.") :]
    if key.startswith("mtp.") and model.mtp is None:
        return None
    if key == "lm_head.weight" and model.lm_head is None:  # tied: the embedding is the head
        return None
    m = _PER_EXPERT.match(key)
    if m:
        shard = _SHARD[m["proj"]]
        name = m["mlp"] + (".w2" if shard == "down" else ".w13")
        e = int(m["e"])
        return name, dict(expert_id=e, shard=shard), lambda p: {(name, e, shard)}
    m = _FUSED.match(key)
    if m:
        name = m["mlp"] + (".w13" if m["proj"] == "gate_up_proj" else ".w2")
        return name, {}, lambda p: set(_param_units(name, p))
    return key, {}, lambda p: {key}


def _param_units(name: str, param: torch.Tensor) -> list:
    if name.endswith(".w13"):
        return [(name, e, s) for e in range(param.num_experts) for s in ("gate", "up")]
    if name.endswith(".w2"):
        return [(name, e, "down") for e in range(param.num_experts)]
    return [name]


def _expected_units(params: dict[str, torch.Tensor]) -> list:
    out = []
    for name, p in params.items():
        out.extend(_param_units(name, p) if hasattr(p, "num_experts") else [name])
    return out


def _unit_key(unit) -> str:
    if isinstance(unit, str):
        return unit
    name, e, shard = unit
    return f"{name.rsplit('.', 1)[0]}.experts.{e}.{shard}_proj.weight"


def init_dummy_weights(model: QwenMoeForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Random weights with the real shapes (vLLM's `--load-format dummy`), seeded and small enough
    that activations and logits stay O(1): matrices ~ N(0, std); norm weights ~ 1 (zero-centred
    ones ~ 0) with a little noise; GDN decay parameters in their trained ranges
    (A_log = log U(1, 16), dt_bias ~ 1). The same model in every layout: each checkpoint-level
    tensor (a parameter's full, unsliced shape; one routed expert's gate / up / down matrix) is
    drawn from its own generator seeded by (seed, its name) and handed to the parameter's weight
    loader, which keeps this rank's TP / EP slice as it would of a checkpoint's. So a TP / EP / DP+EP
    instance on dummy weights computes what one rank does (greedy outputs comparable across
    layouts); a rank draws only the experts it holds."""
    zero_centered = model.config.zero_centered_norm

    def draw(key: str, name: str, shape, device) -> _DummyTensor:
        return _DummyTensor(shape, device, (seed << 32) + zlib.crc32(key.encode()), name, std, zero_centered)

    for name, p in model.named_parameters():
        if hasattr(p, "num_experts"):  # routed experts: one matrix per (expert, shard), local experts only
            hidden = p.shape[2] if p.is_w13 else p.shape[1]
            for e in range(p.expert_offset, p.expert_offset + p.shape[0]):
                for shard in ("gate", "up") if p.is_w13 else ("down",):
                    shape = (p.inter_full, hidden) if shard != "down" else (hidden, p.inter_full)
                    p.weight_loader(p, draw(f"{name}.{e}.{shard}", name, shape, p.device), expert_id=e, shard=shard)
        else:
            shape = list(p.shape)
            full = getattr(p.weight_loader, "full_dim", None)  # a tensor-parallel slice of (dim, length)
            if full is not None:
                shape[full[0]] = full[1]
            p.weight_loader(p, draw(name, name, shape, p.device))


class _DummyTensor:
    """A dummy checkpoint tensor: its full shape, drawn on the first read (a loader may read it in
    slices, each from the same values) by the rules of init_dummy_weights for parameter `name`."""

    def __init__(self, shape, device, seed: int, name: str, std: float, zero_centered: bool):
        self.shape = tuple(shape)
        self._args = (device, seed, name, std, zero_centered)
        self._t = None

    def __getitem__(self, idx) -> torch.Tensor:
        if self._t is None:
            device, seed, name, std, zero_centered = self._args
            g = torch.Generator(device=device).manual_seed(seed)
            x = torch.empty(self.shape, dtype=torch.float32, device=device)
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                x.uniform_(1.0, 16.0, generator=g).log_()
            elif leaf == "dt_bias":
                x.normal_(1.0, 0.1, generator=g)
            elif name.endswith("norm.weight"):
                # GDN's gated norm is a plain `w * x` norm even in the zero-centred families
                centred = zero_centered and ".linear_attn." not in name
                x.normal_(0.0 if centred else 1.0, 0.05, generator=g)
            else:
                x.normal_(0.0, std, generator=g)
            self._t = x
        return self._t[idx]
