"""One rank of the tensor-parallel model tests (started by tests/dist/test_tp_model.py and
tests/dist/test_tp_gpu.py).

    python tp_worker.py CASES_JSON OUT_DIR RANK WORLD STORE_FILE    (CPU: gloo over a file store)
    torchrun --nproc-per-node N tp_worker.py CASES_JSON OUT_DIR     (spec device "cuda": NCCL)

Joins the world, then for every case loads the checkpoint cut by
`ParallelLayout.from_group(world, ep_size=case["ep_size"])`, runs the script of `tp_script`
(prefill of two sequences, MTP drafts, then decode steps) and writes the logits of every step to
OUT_DIR/<case>.rank<R>.safetensors (raw tensors, no pickle). A case may name its dtype and its
MoE backend ($NVL72_MOE_BACKEND). Last, on CPU, the TP all-reduce's bound: rank 0 reduces while
the others arrive LATE_S late, and must get CollectiveTimeout (prints TIMEOUT_OK)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
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
    """Prefill every prompt in one batch (and, with an MTP head, a draft at every prompt position
    from the token after it), then one decode token per sequence per step; returns the logits of
    all of it, concatenated [T_total, V]."""
    run = PagedRunner(model, seed=3)
    batch = run.batch(list(enumerate(prompts)))
    hidden = model(batch, run.caches)  # [T, H]
    out = [model.compute_logits(hidden).cpu()]
    if model.mtp is not None:
        nxt = [t for i, p in enumerate(prompts) for t in p[1:] + [decode[0][i]]]
        mtp_batch = dataclasses.replace(batch, input_ids=torch.tensor(nxt, device=model.device))
        out.append(model.compute_logits(model.forward_mtp(mtp_batch, run.caches, hidden)).cpu())
    for toks in decode:
        out += run.step([(i, [t]) for i, t in enumerate(toks)])
    return torch.cat(out)


def _join(spec: dict, argv: list[str]) -> tuple[int, str]:
    """Init the world; returns (rank, device)."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if spec.get("device", "cpu") == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 stays fp32
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
        return dist.get_rank(), f"cuda:{local}"
    rank, world, store = int(argv[0]), int(argv[1]), argv[2]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    return rank, "cpu"


def _late_peer_check(rank: int) -> None:
    reduce = GroupAllReduce(dist.group.WORLD, timeout=0.5)
    if rank == 0:
        try:
            reduce(torch.ones(4))
        except CollectiveTimeout as e:
            print("TIMEOUT_OK", e, flush=True)
    else:
        time.sleep(LATE_S)
        dist.all_reduce(torch.ones(4))  # completes rank 0's abandoned reduce


def main(cases_json: str, out_dir: str, argv: list[str]) -> None:
    torch.set_num_threads(1)
    with open(cases_json) as f:
        spec = json.load(f)
    rank, device = _join(spec, argv)
    try:
        for case in spec["cases"]:
            if case.get("moe_backend"):
                os.environ["NVL72_MOE_BACKEND"] = case["moe_backend"]
            layout = ParallelLayout.from_group(dist.group.WORLD, ep_size=case["ep_size"], timeout=TIMEOUT_S)
            dtype = getattr(torch, case.get("dtype", "float32"))
            model = load_model(case["path"], dtype=dtype, device=device, parallel=layout)
            with torch.no_grad():
                logits = tp_script(model, spec["prompts"], spec["decode"])
            save_file({"logits": logits.contiguous()}, f"{out_dir}/{case['name']}.rank{rank}.safetensors")
        if device == "cpu":
            _late_peer_check(rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
