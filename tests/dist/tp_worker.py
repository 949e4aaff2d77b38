"""One rank of the tensor-parallel model test (started by tests/dist/test_tp_model.py).

    python tp_worker.py RANK WORLD STORE_FILE CASES_JSON OUT_DIR

Joins a gloo world through a file store, then for every case loads the checkpoint cut by
`ParallelLayout.from_group(world, ep_size=case["ep_size"])`, runs the script of `tp_script`
(prefill of two sequences, then decode steps) and writes the logits of every step to
OUT_DIR/<case>.rank<R>.safetensors (raw tensors, no pickle). Last, the TP all-reduce's bound:
rank 0 reduces while the others arrive LATE_S late, and must get CollectiveTimeout
(prints TIMEOUT_OK)."""
from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from nvl72.model.loader import load_model
from nvl72.model.parallel_layout import GroupAllReduce, ParallelLayout
from nvl72.parallel import CollectiveTimeout
from tests.model.tiny import PagedRunner

TIMEOUT_S = 30.0
LATE_S = 3.0


def tp_script(model, prompts: list[list[int]], decode: list[list[int]]) -> torch.Tensor:
    """Prefill every prompt in one batch, then one decode token per sequence per step; returns
    the logits of all steps, concatenated [T_total, V]."""
    run = PagedRunner(model, seed=3)
    out = run.step(list(enumerate(prompts)))
    for toks in decode:
        out += run.step([(i, [t]) for i, t in enumerate(toks)])
    return torch.cat(out)


def main(rank: int, world: int, store: str, cases_json: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        with open(cases_json) as f:
            spec = json.load(f)
        for case in spec["cases"]:
            layout = ParallelLayout.from_group(dist.group.WORLD, ep_size=case["ep_size"], timeout=TIMEOUT_S)
            model = load_model(case["path"], dtype=torch.float32, device="cpu", parallel=layout)
            with torch.no_grad():
                logits = tp_script(model, spec["prompts"], spec["decode"])
            save_file({"logits": logits.contiguous()}, f"{out_dir}/{case['name']}.rank{rank}.safetensors")
        reduce = GroupAllReduce(dist.group.WORLD, timeout=0.5)
        if rank == 0:
            try:
                reduce(torch.ones(4))
            except CollectiveTimeout as e:
                print("TIMEOUT_OK", e, flush=True)
        else:
            time.sleep(LATE_S)
            dist.all_reduce(torch.ones(4))  # completes rank 0's abandoned reduce
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    r, w, store, cases, out = sys.argv[1:6]
    main(int(r), int(w), store, cases, out)
