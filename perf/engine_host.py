"""Host (Python) time of one steady decode step of `LLMEngine`, split by phase, on a CPU.

    python -m perf.engine_host [--batches 1,64] [--steps 200] [--json perf/out/engine_host.json]

Once the GPU step is short (CUDA graphs), TPOT is bounded by the host work of a step. This runs a
tiny dummy-weight Qwen3-MoE-shaped model (built here, fp32) on the CPU so the engine's own host
path dominates, drives `batch` greedy ignore_eos requests into steady decode, then times
`--steps` steps with `time.perf_counter` around the engine's phases (wrapped from outside, so the
engine carries no timer):
  schedule   `Scheduler.schedule`
  prepare    `runner.placeholder_fill` + `runner.build_batch` + the async placeholder patch
  forward    the model forward and `compute_logits` (the tiny model's CPU time: exclude it)
  sample     `Sampler.sample`
  runner     the rest of `ModelRunner.run` (sample rows, logits row gather)
  readback   `DeviceSample.copy_to_host` + `DeviceSample.result`
  post       the rest of `LLMEngine.step` (placeholders, commit, stop checks, outputs)
  host       the step less forward
Medians over steps, in microseconds. On a CPU nothing overlaps and there are no pinned copies:
the GPU effect of any change is not measured here. The CPU engine does not capture CUDA graphs, so a
second table times what a graphed decode step does on the host instead of `prepare`: `flatten` and
`Staging.write` into the graphs' staging buffers (decode sequences of 200 tokens in 16-token pages).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager

import torch

from nvl72.config import ModelConfig
from nvl72.engine import runner as runner_mod
from nvl72.engine.cuda_graphs import Staging
from nvl72.engine.engine import EngineConfig, LLMEngine
from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.engine.sampler import DeviceSample
from nvl72.engine.scheduler import ScheduledSeq
from nvl72.engine.sequence import Sequence
from nvl72.model.loader import build_model, init_dummy_weights

TINY_MOE = dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, rms_norm_eps=1e-6, max_position_embeddings=4096, eos_token_id=[0])
PHASES = ("schedule", "prepare", "forward", "sample", "runner", "readback", "post", "host", "step")


class PhaseTimes:
    """Seconds spent per phase during the current step (wrappers add to `acc`)."""

    def __init__(self):
        self.acc = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, fn):
        acc = self.acc

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[phase] += time.perf_counter() - t
        return timed


class _TimedModel:
    """The model seen by the runner: forward and compute_logits timed as `forward`."""

    def __init__(self, model, times: PhaseTimes):
        self._model = model
        self.forward = times.wrap("forward", model)
        self.compute_logits = times.wrap("forward", model.compute_logits)

    def __call__(self, *a, **kw):
        return self.forward(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


@contextmanager
def instrumented(engine: LLMEngine, times: PhaseTimes):
    """Wrap the engine's phases (module functions and DeviceSample methods restored on exit)."""
    saved = [(runner_mod, "build_batch"), (runner_mod, "placeholder_fill"), (runner_mod, "patch_placeholders"),
             (DeviceSample, "copy_to_host"), (DeviceSample, "result")]
    saved = [(o, n, getattr(o, n)) for o, n in saved]
    runner = engine.runner
    inner = dict(model=runner.model, sample=runner.sampler.sample, run=runner.run, schedule=engine.scheduler.schedule)
    for o, n, f in saved:
        setattr(o, n, times.wrap("readback" if o is DeviceSample else "prepare", f))
    runner.model = _TimedModel(inner["model"], times)
    runner.sampler.sample = times.wrap("sample", inner["sample"])
    runner.run = times.wrap("runner", inner["run"])
    engine.scheduler.schedule = times.wrap("schedule", inner["schedule"])
    try:
        yield
    finally:
        for o, n, f in saved:
            setattr(o, n, f)
        runner.model = inner["model"]
        del runner.sampler.sample, runner.run, engine.scheduler.schedule


def build_tiny_moe(seed: int = 1):
    model = build_model(ModelConfig.from_dict(TINY_MOE), torch.float32, "cpu")
    init_dummy_weights(model, seed=seed, std=0.3)
    return model


def measure(model, batch: int, overlap: bool, steps: int, prompt_len: int, temperature: float) -> dict:
    """Per-phase medians (us) of `steps` steady decode steps of `batch` sequences."""
    warm = 8
    cfg = EngineConfig(max_model_len=prompt_len + warm + steps + 16, max_num_seqs=max(batch, 1),
                       max_num_batched_tokens=max(2048, prompt_len), page_size=16, async_scheduling=overlap,
                       enable_prefix_caching=False)
    engine = LLMEngine(model, cfg, eos_token_ids=[0])
    g = torch.Generator().manual_seed(batch)
    sp = SamplingParams(max_tokens=warm + steps + 8, temperature=temperature, ignore_eos=True, seed=None)
    for i in range(batch):
        ids = torch.randint(1, TINY_MOE["vocab_size"], (prompt_len,), generator=g).tolist()
        engine.add_request(AddRequest(f"r{i}", ids, sp))
    while any(s.in_prefill or s.num_computed == 0 for s in engine.seqs.values()):
        engine.step()
    for _ in range(warm):
        engine.step()
    times = PhaseTimes()
    rows = {p: [] for p in PHASES}
    with instrumented(engine, times):
        for _ in range(steps):
            times.acc.update(dict.fromkeys(PHASES, 0.0))
            t = time.perf_counter()
            outs = engine.step()
            step = time.perf_counter() - t
            if len(outs) != batch:
                raise RuntimeError(f"a steady step of batch {batch} gave {len(outs)} outputs")
            a = times.acc
            a["runner"] -= a["prepare"] + a["forward"] + a["sample"]
            a["post"] = step - a["schedule"] - a["prepare"] - a["forward"] - a["sample"] - a["runner"] - a["readback"]
            a["host"], a["step"] = step - a["forward"], step
            for p in PHASES:
                rows[p].append(a[p] * 1e6)
    engine.shutdown()
    return {p: statistics.median(v) for p, v in rows.items()}


def graphed_inputs_us(batch: int, steps: int, context: int = 200, page: int = 16) -> float:
    """Median us of a graphed step's host inputs (runner.flatten + Staging.write) for `batch` decode
    sequences (the staging sized as for 128 sequences of 64 pages, unpinned)."""
    sched = []
    for i in range(batch):
        seq = Sequence(f"r{i}", list(range(context)), context - 1, SamplingParams(), 0, num_computed=context - 1)
        seq.pages = list(range(i * 20, i * 20 + -(-context // page)))
        sched.append(ScheduledSeq(seq, 1, []))
    staging = Staging(128, 1, 64, False, scratch_page=0, scratch_slot=0, pin=False)
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        staging.write(runner_mod.flatten(sched, False), batch)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--modes", default="sync,async", help="sync and/or async scheduling")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded random sampling")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: tiny ops without OpenMP spin)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_tiny_moe()
    res = {"config": vars(args), "torch": torch.__version__, "results": []}
    for b in (int(x) for x in args.batches.split(",")):
        for mode in args.modes.split(","):
            if mode not in ("sync", "async"):
                raise ValueError(f"--modes: {mode!r} is not sync or async")
            r = measure(model, b, mode == "async", args.steps, args.prompt_len, args.temperature)
            res["results"].append(dict(batch=b, mode=mode, **r))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"engine host time per decode step, CPU, median us over {args.steps} steps (forward = tiny model, excluded from host)")
    print("| batch | mode | " + " | ".join(PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for r in res["results"]:
        print(f"| {r['batch']} | {r['mode']} | " + " | ".join(f"{r[p]:.1f}" for p in PHASES) + " |")
    print(f"\ngraphed step's host inputs (runner.flatten + Staging.write), median us over {10 * args.steps} calls")
    print("| batch | us |\n|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        print(f"| {b} | {graphed_inputs_us(b, 10 * args.steps):.1f} |")
    return res


if __name__ == "__main__":
    main()
