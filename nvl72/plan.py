"""`nvl72 plan`: size and place prefill and decode instances on a rack for a model and token rates.

Shape of a deployment (DESIGN.md): a prefill instance is one node (TP attention, EP experts over
the node's GPUs); a decode instance is DP attention + EP over `decode_size` ranks (16 = four nodes)
of one NVLink domain; the front runs on the host CPU of the first node, beside rank 0.

Cost model (every constant comes from `plan_constants.json`, with its source; the report says
"estimated, not measured" for every constant not measured on the hardware):
  * prefill, compute bound: seconds per token on one GPU = dense FLOPs / (BF16 peak x MFU)
    + expert FLOPs / (FP8 peak x MFU) (MXFP8 experts); an instance of TP GPUs adds its two
    all-reduces per layer. Instances = ceil(input rate / (capacity x target utilisation)).
  * decode, bandwidth bound: one step of a rank at batch B reads its replicated dense weights, the
    local experts the instance's B x EP tokens touch, the KV of B sequences and their GDN states;
    plus a dispatch + combine per layer and a fixed step overhead. A rank serves B / step tokens/s,
    so keeping every rank's batch at or under the threshold B needs
    ranks = ceil(output rate x step(B) / B).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass, field

from nvl72.topology import Node, Rack, TopologyError

CONSTANTS_PATH = pathlib.Path(__file__).with_name("plan_constants.json")
EXPERT_BYTES = 1 + 1 / 32  # MXFP8: one byte per weight + one e8m0 scale per 32
DENSE_BYTES = 2  # BF16
KV_BYTES = 2  # BF16 KV cache
NOT_MEASURED = "estimated, not measured"


class PlanError(ValueError):
    """A plan that cannot be made (bad model, rack or sizes); the message names the bad value."""


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """The key figures of a Qwen MoE config (names as in config.json)."""

    name: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    vocab_size: int
    shared_expert_intermediate_size: int = 0
    full_attention_interval: int = 1  # every n-th layer is full attention, the others GDN
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    stated_total_b: float | None = None  # from the model card, billions
    stated_active_b: float | None = None

    @property
    def hybrid(self) -> bool:
        return self.full_attention_interval > 1

    @property
    def attn_layers(self) -> int:
        return self.num_hidden_layers // self.full_attention_interval

    @property
    def gdn_layers(self) -> int:
        return self.num_hidden_layers - self.attn_layers

    def _attn_params(self) -> int:
        q_out = self.num_attention_heads * self.head_dim * (2 if self.hybrid else 1)  # gated: q + gate
        kv = 2 * self.num_key_value_heads * self.head_dim
        return self.hidden_size * (q_out + kv) + self.num_attention_heads * self.head_dim * self.hidden_size

    def _gdn_params(self) -> int:
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        in_proj = self.hidden_size * (2 * key_dim + 2 * value_dim + 2 * self.linear_num_value_heads)  # qkvz + ba
        return in_proj + self.conv_dim * self.linear_conv_kernel_dim + value_dim * self.hidden_size

    @property
    def conv_dim(self) -> int:
        """GDN conv channels: [q | k | v]."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def expert_params(self) -> int:
        """Routed-expert weights of the whole model (gate, up, down)."""
        return self.num_hidden_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def dense_params(self) -> int:
        """Everything but the routed experts and the embedding table (lm_head included)."""
        per_layer_moe = self.hidden_size * self.num_experts + 3 * self.hidden_size * self.shared_expert_intermediate_size
        layers = self.attn_layers * self._attn_params() + self.gdn_layers * self._gdn_params()
        return layers + self.num_hidden_layers * per_layer_moe + self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return self.dense_params + self.expert_params + self.vocab_size * self.hidden_size

    @property
    def active_expert_params(self) -> int:
        return self.expert_params * self.num_experts_per_tok // self.num_experts

    @property
    def active_params(self) -> int:
        return self.dense_params + self.active_expert_params + self.vocab_size * self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        return self.attn_layers * 2 * self.num_key_value_heads * self.head_dim * KV_BYTES

    @property
    def state_bytes_per_seq(self) -> int:
        """GDN conv tail (bf16) + recurrent state (fp32) of one sequence, all GDN layers."""
        if not self.hybrid:
            return 0
        conv = self.conv_dim * (self.linear_conv_kernel_dim - 1) * 2
        rec = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        return self.gdn_layers * (conv + rec)

    def summary(self) -> str:
        s = (f"{self.name} ({self.model_type}): {self.num_hidden_layers} layers ({self.attn_layers} attention, "
             f"{self.gdn_layers} GDN), hidden {self.hidden_size}, {self.num_experts} experts top-{self.num_experts_per_tok}"
             f"{' + shared' if self.shared_expert_intermediate_size else ''}, {self.num_attention_heads} q / "
             f"{self.num_key_value_heads} kv heads x {self.head_dim}; {self.total_params / 1e9:.1f}B params")
        if self.stated_total_b:
            s += f" (stated {self.stated_total_b:g}B)"
        s += f", {self.active_params / 1e9:.1f}B active"
        if self.stated_active_b:
            s += f" (stated {self.stated_active_b:g}B)"
        return s

    @classmethod
    def from_config(cls, cfg: dict, name: str) -> ModelSpec:
        """From a Hugging Face config.json dict, parsed by the model's own `ModelConfig`."""
        from nvl72.config import FULL_ATTENTION, ConfigError, ModelConfig

        try:
            mc = ModelConfig.from_dict(cfg)
        except ConfigError as e:
            raise PlanError(f"{name}: {e}") from None
        attn = mc.layer_types.count(FULL_ATTENTION)
        if attn == 0 or mc.num_hidden_layers % attn:
            raise PlanError(f"{name}: {attn} full-attention layers of {mc.num_hidden_layers} is not a periodic layout")
        kw = {f.name: getattr(mc, f.name) for f in dataclasses.fields(cls)
              if f.name not in ("name", "full_attention_interval", "stated_total_b", "stated_active_b")}
        return cls(name=name, full_attention_interval=mc.num_hidden_layers // attn, **kw)


def _q35(name, layers, hidden, experts, topk, inter, total, active, v_heads, vocab=248320, heads=32, kv=2, mt="qwen3_5_moe"):
    return ModelSpec(name, mt, layers, hidden, heads, kv, 256, experts, topk, inter, vocab,
                     shared_expert_intermediate_size=inter, full_attention_interval=4, linear_num_key_heads=16,
                     linear_num_value_heads=v_heads, linear_key_head_dim=128, linear_value_head_dim=128,
                     linear_conv_kernel_dim=4, stated_total_b=total, stated_active_b=active)


# Key figures of the released configs (Hugging Face Qwen/<name>/config.json), so the plan works offline.
MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("Qwen3-235B-A22B", "qwen3_moe", 94, 4096, 64, 4, 128, 128, 8, 1536, 151936,
              stated_total_b=235, stated_active_b=22),
    ModelSpec("Qwen3-30B-A3B", "qwen3_moe", 48, 2048, 32, 4, 128, 128, 8, 768, 151936,
              stated_total_b=30.5, stated_active_b=3.3),
    _q35("Qwen3.5-397B-A17B", 60, 4096, 512, 10, 1024, 397, 17, v_heads=64),
    _q35("Qwen3.5-122B-A10B", 48, 3072, 256, 8, 1024, 122, 10, v_heads=64),
    _q35("Qwen3-Next-80B-A3B", 48, 2048, 512, 10, 512, 80, 3, v_heads=32, vocab=151936, heads=16,
         mt="qwen3_next"),
)}


def load_model(spec: str) -> ModelSpec:
    """A built-in name (Qwen/ prefix optional), a config.json path or a checkpoint directory."""
    key = spec.removeprefix("Qwen/")
    if key in MODELS:
        return MODELS[key]
    path = pathlib.Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"model {spec!r}: not a built-in model {sorted(MODELS)} and no config.json there")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: not valid JSON: {e}") from e
    return ModelSpec.from_config(cfg, path.parent.name or str(path))


# ---------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Constant:
    name: str
    value: float
    unit: str
    source: str
    measured: bool
    date: str = ""

    def describe(self) -> str:
        tag = f"measured {self.date}".strip() if self.measured else NOT_MEASURED
        return f"{self.name} = {self.value:g} {self.unit} ({tag}; {self.source})"


class Constants:
    """The cost model's constants for one GPU type, each remembered with its source."""

    def __init__(self, gpu: str, path: pathlib.Path = CONSTANTS_PATH):
        data = json.loads(path.read_text())
        if gpu not in data["hardware"]:
            raise PlanError(f"gpu {gpu!r}: no hardware figures in {path.name} (known: {sorted(data['hardware'])})")
        self.gpu = gpu
        self.used: dict[str, Constant] = {}
        self._raw = {f"{k}[{gpu}]": v for k, v in data["hardware"][gpu].items()}
        for section in ("efficiency", "policy"):
            self._raw.update(data[section])

    def __getitem__(self, key: str) -> float:
        name = f"{key}[{self.gpu}]" if f"{key}[{self.gpu}]" in self._raw else key
        if name not in self._raw:
            raise PlanError(f"constant {key!r} is missing from {CONSTANTS_PATH.name}")
        e = self._raw[name]
        self.used[name] = Constant(name, float(e["value"]), e["unit"], e["source"], bool(e.get("measured", False)),
                                   e.get("date", ""))
        return float(e["value"])


# ---------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    input_tps: float
    output_tps: float
    prompt_len: int = 4096
    output_len: int = 1024
    decode_batch_threshold: int = 128


def prefill_capacity(m: ModelSpec, c: Constants, tp: int, w: Workload) -> tuple[float, list[str]]:
    """Prompt tokens/s of one prefill instance of `tp` GPUs, and the arithmetic behind it."""
    mfu = c["prefill_mfu"]
    attn_core = m.attn_layers * 4 * m.num_attention_heads * m.head_dim * (w.prompt_len / 2)  # QK^T + PV, causal mean
    gdn_core = m.gdn_layers * 8 * m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim
    dense_flops = 2 * m.dense_params + attn_core + gdn_core
    expert_flops = 2 * m.active_expert_params
    t_dense = dense_flops / (c["bf16_tflops"] * 1e12 * mfu)
    t_expert = expert_flops / (c["fp8_tflops"] * 1e12 * mfu)
    ar_bytes = 2 * m.num_hidden_layers * 2 * (tp - 1) / tp * m.hidden_size * DENSE_BYTES  # 2 all-reduces a layer
    t_comm = ar_bytes / (c["nvlink_gbps"] * 1e9 * c["nvlink_efficiency"])
    per_token = (t_dense + t_expert) / tp + t_comm
    cap = 1 / per_token
    why = [
        f"compute per prompt token: {dense_flops / 1e9:.1f} GFLOP dense+attention (prompt {w.prompt_len}) at "
        f"{c['bf16_tflops']:g} TFLOP/s BF16 x {mfu:g} MFU = {t_dense * 1e6:.2f} us, {expert_flops / 1e9:.1f} GFLOP "
        f"experts at {c['fp8_tflops']:g} TFLOP/s FP8 x {mfu:g} = {t_expert * 1e6:.2f} us (one GPU)",
        f"all-reduce per token: {ar_bytes / 1e3:.1f} kB over NVLink {c['nvlink_gbps']:g} GB/s x "
        f"{c['nvlink_efficiency']:g} = {t_comm * 1e6:.2f} us",
        f"capacity per instance: 1 / ({(t_dense + t_expert) * 1e6:.2f} us / {tp} GPUs + {t_comm * 1e6:.2f} us) "
        f"= {cap:,.0f} prompt tok/s",
    ]
    return cap, why


@dataclass(frozen=True)
class DecodeStep:
    batch: int
    seconds: float
    why: list[str]


def decode_step(m: ModelSpec, c: Constants, ep: int, batch: int, w: Workload) -> DecodeStep:
    """One decode step of one DP rank at `batch` sequences in an instance of `ep` ranks."""
    ctx = w.prompt_len + w.output_len / 2
    local_experts = m.num_experts / ep
    untouched = (1 - m.num_experts_per_tok / m.num_experts) ** (batch * ep)  # per expert, per layer
    expert_bytes = local_experts * (1 - untouched) * m.expert_params / m.num_experts * EXPERT_BYTES
    dense_bytes = m.dense_params * DENSE_BYTES
    kv_bytes = batch * ctx * m.kv_bytes_per_token
    state_bytes = 2 * batch * m.state_bytes_per_seq  # read + write
    total = expert_bytes + dense_bytes + kv_bytes + state_bytes
    t_mem = total / (c["hbm_tbps"] * 1e12 * c["decode_hbm_efficiency"])
    t_comp = batch * 2 * m.active_params / (c["bf16_tflops"] * 1e12 * c["prefill_mfu"])
    comm_bytes = m.num_hidden_layers * batch * m.num_experts_per_tok * m.hidden_size * (1 + DENSE_BYTES)  # fp8 out, bf16 back
    t_comm = (m.num_hidden_layers * c["dispatch_combine_latency_us"] * 1e-6
              + comm_bytes / (c["nvlink_gbps"] * 1e9 * c["nvlink_efficiency"]))
    t_over = c["decode_step_overhead_us"] * 1e-6
    step = max(t_mem, t_comp) + t_comm + t_over
    why = [
        f"HBM per step: dense weights {dense_bytes / 1e9:.2f} GB + touched local experts {expert_bytes / 1e9:.2f} GB "
        f"({local_experts:g} local, {1 - untouched:.0%} touched by {batch} x {ep} tokens) + KV {kv_bytes / 1e9:.2f} GB "
        f"({batch} seqs x {ctx:.0f} tokens x {m.kv_bytes_per_token / 1e3:.1f} kB)"
        + (f" + GDN states {state_bytes / 1e9:.2f} GB" if state_bytes else "")
        + f" = {total / 1e9:.2f} GB at {c['hbm_tbps']:g} TB/s x {c['decode_hbm_efficiency']:g} = {t_mem * 1e3:.2f} ms",
        f"compute per step: {t_comp * 1e3:.2f} ms; dispatch+combine: {m.num_hidden_layers} layers x "
        f"{c['dispatch_combine_latency_us']:g} us + {comm_bytes / 1e6:.1f} MB = {t_comm * 1e3:.2f} ms; "
        f"step overhead {t_over * 1e3:.2f} ms",
        f"step at batch {batch}: max({t_mem * 1e3:.2f}, {t_comp * 1e3:.2f}) + {t_comm * 1e3:.2f} + {t_over * 1e3:.2f} "
        f"= {step * 1e3:.2f} ms -> {batch / step:,.0f} tok/s per rank",
    ]
    return DecodeStep(batch, step, why)


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------
@dataclass
class Instance:
    role: str  # "prefill" | "decode"
    index: int
    ranks: list[int]
    tp: int  # attention tensor parallelism (ranks sharing one request's heads)
    ep: int  # expert parallelism (all ranks of the instance)

    @property
    def dp(self) -> int:
        return len(self.ranks) // self.tp

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


@dataclass
class Plan:
    rack: Rack
    model: str
    instances: list[Instance]
    front_rank: int  # the front runs on this rank's host, beside it
    explanation: list[str] = field(default_factory=list)

    def instance_of(self, rank: int) -> Instance | None:
        for inst in self.instances:
            if rank in inst.ranks:
                return inst
        return None

    def of_role(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    def spare_ranks(self) -> list[int]:
        used = {r for i in self.instances for r in i.ranks}
        return [r for r in range(self.rack.world_size) if r not in used]

    def layout(self) -> list[str]:
        rack = self.rack

        def where(ranks: list[int]) -> str:
            nodes = sorted({rack.node_of_rank(r) for r in ranks})
            names = [rack.nodes[n].name for n in nodes]
            hosts = names[0] if len(names) == 1 else f"{len(names)} nodes {_spans(nodes, names)}"
            doms = sorted({rack.nodes[n].domain for n in nodes})
            return f"{hosts}, ranks {_spans(ranks)}, domain {','.join(doms)}"

        front_node = rack.nodes[rack.node_of_rank(self.front_rank)].name
        out = [f"  front       : {front_node} host CPU, beside rank {self.front_rank} (HTTP, tokenizer, router)"]
        for inst in self.instances:
            par = (f"TP{inst.tp}/EP{inst.ep}" if inst.role == "prefill"
                   else f"DP{inst.dp}{f' x TP{inst.tp}' if inst.tp > 1 else ''} attention + EP{inst.ep}")
            out.append(f"  {inst.name:<12}: {where(inst.ranks)}  [{par}]")
        spare = self.spare_ranks()
        if spare:
            out.append(f"  spare       : {len(spare)} ranks, {where(spare)} - idle headroom")
        return out

    def to_json(self) -> str:
        return json.dumps({
            "rack": {"name": self.rack.name, "gpu": self.rack.gpu, "fabric_handles": self.rack.fabric_handles,
                     "multicast": self.rack.multicast, "nodes": [dataclasses.asdict(n) for n in self.rack.nodes]},
            "model": self.model, "front_rank": self.front_rank,
            "instances": [{"role": i.role, "index": i.index, "ranks": i.ranks, "tp": i.tp, "ep": i.ep}
                          for i in self.instances],
            "explanation": self.explanation,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> Plan:
        try:
            d = json.loads(text)
            r = d["rack"]
            rack = Rack(r["name"], r["gpu"], tuple(Node(**n) for n in r["nodes"]), r["fabric_handles"], r["multicast"])
            insts = [Instance(i["role"], i["index"], list(i["ranks"]), i["tp"], i["ep"]) for i in d["instances"]]
            plan = cls(rack, d["model"], insts, d["front_rank"], list(d.get("explanation", [])))
        except (KeyError, TypeError, json.JSONDecodeError, TopologyError) as e:
            raise PlanError(f"{where}: not a plan written by `nvl72 plan --out`: {e!r}") from e
        plan.validate()
        return plan

    def validate(self) -> None:
        seen: dict[int, str] = {}
        for inst in self.instances:
            if inst.role not in ("prefill", "decode"):
                raise PlanError(f"{inst.name}: role must be prefill or decode")
            if not inst.ranks or inst.tp <= 0 or len(inst.ranks) % inst.tp:
                raise PlanError(f"{inst.name}: {len(inst.ranks)} ranks are not a multiple of tp={inst.tp}")
            for r in inst.ranks:
                if not 0 <= r < self.rack.world_size:
                    raise PlanError(f"{inst.name}: rank {r} is outside the rack's {self.rack.world_size} ranks")
                if r in seen:
                    raise PlanError(f"rank {r} is in both {seen[r]} and {inst.name}")
                seen[r] = inst.name
        if not 0 <= self.front_rank < self.rack.world_size:
            raise PlanError(f"front_rank {self.front_rank} is outside the rack")


def _spans(items: list[int], names: list[str] | None = None) -> str:
    """'0-3,8-11' for sorted integers (or their names: 'node00..node03,node08')."""
    names = names or [str(i) for i in items]
    sep = "-" if names[0].isdigit() else ".."
    out, start = [], 0
    for i in range(1, len(items) + 1):
        if i == len(items) or items[i] != items[i - 1] + 1:
            out.append(names[start] if start == i - 1 else f"{names[start]}{sep}{names[i - 1]}")
            start = i
    return ",".join(out)


def _blocks(rack: Rack, size: int, within: str) -> dict[str, list[list[int]]]:
    """Per NVLink domain, the aligned rank blocks of `size` ranks that stay within one node
    (`within="node"`) or one domain (`within="domain"`), in rank order."""
    out: dict[str, list[list[int]]] = {}
    for dom, nodes in rack.domains().items():
        blocks: list[list[int]] = []
        if within == "node":
            for n in nodes:
                ranks = list(rack.node_ranks(n))
                blocks += [ranks[i:i + size] for i in range(0, len(ranks) - size + 1, size)]
        else:  # aligned to the domain's end, so the domain's first nodes stay whole for prefill
            ranks = [r for n in nodes for r in rack.node_ranks(n)]
            blocks += [ranks[i - size:i] for i in range(len(ranks), size - 1, -size)][::-1]
        out[dom] = blocks
    return out


def _place(rack: Rack, n_prefill: int, n_decode: int, prefill_tp: int, decode_size: int) -> tuple[list[list[int]], list[list[int]]] | None:
    """Decode blocks from the end of each domain, taken round-robin over the domains (a domain's
    loss takes the fewest decoders), prefill blocks from the front of what is left, round-robin too."""
    within_p = "node" if prefill_tp <= min(n.gpus for n in rack.nodes) else "domain"
    decode: list[list[int]] = []
    taken: set[int] = set()
    per_domain = [list(reversed(b)) for b in _blocks(rack, decode_size, "domain").values()]
    for k in range(max((len(b) for b in per_domain), default=0)):
        for blocks in per_domain:
            if k < len(blocks) and len(decode) < n_decode:
                decode.append(blocks[k])
                taken.update(blocks[k])
    if len(decode) < n_decode:
        return None
    prefill: list[list[int]] = []
    free = [[b for b in blocks if not taken.intersection(b)] for blocks in _blocks(rack, prefill_tp, within_p).values()]
    for k in range(max((len(b) for b in free), default=0)):
        for blocks in free:
            if k < len(blocks) and len(prefill) < n_prefill:
                prefill.append(blocks[k])
    if len(prefill) < n_prefill:
        return None
    return sorted(prefill), sorted(decode)


def make_plan(rack: Rack, model: ModelSpec, w: Workload, prefill_tp: int | None = None, decode_size: int | None = None,
              decode_tp: int = 1, prefill_instances: int | None = None, decode_instances: int | None = None,
              constants_path: pathlib.Path = CONSTANTS_PATH) -> Plan:
    """Size prefill and decode instances from the cost model (or take fixed counts) and place them."""
    gpn = min(n.gpus for n in rack.nodes)
    prefill_tp = prefill_tp or min(gpn, 4)
    largest_domain = max(sum(rack.nodes[n].gpus for n in ns) for ns in rack.domains().values())
    decode_size = decode_size or min(16, largest_domain)
    for label, v in (("prefill TP", prefill_tp), ("decode size", decode_size), ("decode TP", decode_tp)):
        if v <= 0:
            raise PlanError(f"{label} must be positive, got {v}")
    if decode_size % decode_tp:
        raise PlanError(f"decode size {decode_size} is not a multiple of decode TP {decode_tp}")
    for label, ep in (("prefill EP", prefill_tp), ("decode EP", decode_size)):
        if model.num_experts % ep:
            raise PlanError(f"{label}={ep} does not divide {model.name}'s {model.num_experts} experts")
    for label, tp in (("prefill TP", prefill_tp), ("decode TP", decode_tp)):
        if model.num_attention_heads % tp:
            raise PlanError(f"{label}={tp} does not divide {model.name}'s {model.num_attention_heads} attention heads")
    if w.input_tps < 0 or w.output_tps < 0:
        raise PlanError(f"token rates must be non-negative, got input {w.input_tps}, output {w.output_tps}")
    if w.decode_batch_threshold <= 0:
        raise PlanError(f"decode batch threshold must be positive, got {w.decode_batch_threshold}")

    why = [rack.describe(), "model: " + model.summary(),
           f"workload: {w.input_tps:,.0f} input tok/s, {w.output_tps:,.0f} output tok/s, prompt {w.prompt_len} "
           f"and output {w.output_len} tokens per request, decode batch threshold {w.decode_batch_threshold} per rank"]
    sized = rack.gpu != "cpu"
    if sized:
        c = Constants(rack.gpu, constants_path)
        cap, pwhy = prefill_capacity(model, c, prefill_tp, w)
        util = c["prefill_target_utilisation"]
        need_p = math.ceil(w.input_tps / (cap * util)) if w.input_tps else 0
        why.append(f"prefill: TP{prefill_tp}/EP{prefill_tp} instances of {prefill_tp} ranks")
        mem_frac, hbm = c["memory_fraction"], c["hbm_gib"] * 2**30
        p_weights = ((model.dense_params + model.vocab_size * model.hidden_size) * DENSE_BYTES
                     + model.expert_params * EXPERT_BYTES) / prefill_tp
        why.append(f"  memory per rank: weights {p_weights / 2**30:.1f} GiB of {hbm / 2**30:.0f} GiB x {mem_frac:g}")
        if p_weights > hbm * mem_frac:
            raise PlanError(f"{model.name} does not fit a prefill rank of TP{prefill_tp}: weights need "
                            f"{p_weights / 2**30:.1f} GiB of {hbm * mem_frac / 2**30:.0f} GiB")
        why += ["  " + s for s in pwhy]
        why.append(f"  needed: ceil({w.input_tps:,.0f} / ({cap:,.0f} x {util:g} target utilisation)) = {need_p} instance(s)")

        batch = w.decode_batch_threshold
        weights = (model.dense_params * DENSE_BYTES + model.expert_params / decode_size * EXPERT_BYTES
                   + model.vocab_size * model.hidden_size * DENSE_BYTES)
        per_seq = (w.prompt_len + w.output_len) * model.kv_bytes_per_token + model.state_bytes_per_seq
        fit = int((hbm * mem_frac - weights) // per_seq)
        why.append(f"decode: DP{decode_size // decode_tp} attention + EP{decode_size} experts per instance of {decode_size} ranks")
        why.append(f"  memory per rank: weights {weights / 2**30:.1f} GiB + {per_seq / 2**20:.1f} MiB per sequence "
                   f"(KV + states at {w.prompt_len + w.output_len} tokens) in {hbm / 2**30:.0f} GiB x {mem_frac:g} "
                   f"-> {max(fit, 0)} sequences fit")
        if fit <= 0:
            raise PlanError(f"{model.name} does not fit a decode rank of EP{decode_size}: weights need "
                            f"{weights / 2**30:.1f} GiB of {hbm * mem_frac / 2**30:.0f} GiB")
        if fit < batch:
            why.append(f"  batch threshold {batch} exceeds what fits; using {fit}")
            batch = fit
        step = decode_step(model, c, decode_size, batch, w)
        why += ["  " + s for s in step.why]
        ranks = math.ceil(w.output_tps * step.seconds / batch) if w.output_tps else 0
        need_d = math.ceil(ranks / decode_size)
        why.append(f"  needed: ceil({w.output_tps:,.0f} tok/s x {step.seconds * 1e3:.2f} ms / {batch}) = {ranks} ranks "
                   f"-> {need_d} instance(s) of {decode_size}")
    else:
        c = None
        need_p = need_d = 0
        why.append("rack of CPU workers: no cost model; instance counts must be given")
    if prefill_instances is not None:
        why.append(f"prefill instances fixed at {prefill_instances} by the caller (cost model: {need_p})")
        need_p = prefill_instances
    if decode_instances is not None:
        why.append(f"decode instances fixed at {decode_instances} by the caller (cost model: {need_d})")
        need_d = decode_instances
    if not sized and (prefill_instances is None or decode_instances is None):
        raise PlanError("a CPU rack needs --prefill-instances and --decode-instances")

    placed = _place(rack, need_p, need_d, prefill_tp, decode_size)
    if placed is None:
        # Over demand: the split that serves the largest common fraction of both rates.
        best = None
        for d in range(0, min(need_d, rack.world_size // decode_size) + 1):
            for p in range(min(need_p, rack.world_size // prefill_tp), -1, -1):
                got = _place(rack, p, d, prefill_tp, decode_size)
                if got is not None:
                    frac = min(p / need_p if need_p else 1, d / need_d if need_d else 1)
                    if best is None or frac > best[0]:
                        best = (frac, p, d, got)
                    break
        if best is None or (best[1] == 0 and need_p) or (best[2] == 0 and need_d):
            raise PlanError(f"rack {rack.name} cannot hold one prefill instance of {prefill_tp} ranks and one decode "
                            f"instance of {decode_size} ranks in one NVLink domain")
        frac, p, d, placed = best
        why.append(f"OVER CAPACITY: the rates need {need_p} prefill + {need_d} decode instances; the rack holds "
                   f"{p} + {d}, which serves about {frac:.0%} of the requested rates")
    prefill_blocks, decode_blocks = placed
    instances = [Instance("prefill", i, b, prefill_tp, prefill_tp) for i, b in enumerate(prefill_blocks)]
    instances += [Instance("decode", i, b, decode_tp, decode_size) for i, b in enumerate(decode_blocks)]
    if c is not None:
        why.append("constants:")
        why += ["  " + k.describe() for k in c.used.values()]
    plan = Plan(rack, model.name, instances, front_rank=0, explanation=why)
    plan.validate()
    return plan


# ---------------------------------------------------------------------------------------------
# Measuring the hardware constants
# ---------------------------------------------------------------------------------------------
def measure_constants(command: str) -> dict:
    """Measure this machine's hardware figures (the `hardware` entries of plan_constants.json):
    BF16 and FP8 GEMM throughput (8192^3, random data), HBM bandwidth (device copy of 4 GiB, bytes
    read + written), and NVLink bandwidth (1 GiB copy GPU 0 -> GPU 1, when there are two)."""
    import datetime

    import torch

    from nvl72.cuda_timing import hbm_copy_bandwidth, time_cuda

    if not torch.cuda.is_available():
        raise PlanError("--measure-constants needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    gpu = next((g for g in ("GB200", "B200", "H200", "H100") if g in name), name)
    date = datetime.date.today().isoformat()

    def entry(value, unit, what):
        return {"value": round(value, 3), "unit": unit, "measured": True, "date": date, "command": command,
                "source": f"measured on {name}: {what}"}

    out = {}
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(lambda: a @ b)
    out["bf16_tflops"] = entry(2 * n**3 / t / 1e12, "TFLOP/s", f"torch bf16 matmul {n}^3, mean of 10")
    if hasattr(torch, "float8_e4m3fn") and torch.cuda.get_device_capability() >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device="cuda")
        t = time_cuda(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
        out["fp8_tflops"] = entry(2 * n**3 / t / 1e12, "TFLOP/s", f"torch._scaled_mm e4m3 {n}^3, mean of 10")
    del a, b
    out["hbm_tbps"] = entry(hbm_copy_bandwidth(2**32, 10) / 1e12, "TB/s",
                            "device copy of 4 GiB, bytes read + written")
    out["hbm_gib"] = entry(torch.cuda.get_device_properties(0).total_memory / 2**30, "GiB", "total device memory")
    if torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1):
        src = torch.empty(2**30, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(2**30, dtype=torch.uint8, device="cuda:1")
        t = time_cuda(lambda: dst.copy_(src, non_blocking=True))
        out["nvlink_gbps"] = entry(src.numel() / t / 1e9, "GB/s per direction", "peer copy of 1 GiB, GPU 0 -> GPU 1")
    return {"hardware": {gpu: out}}
