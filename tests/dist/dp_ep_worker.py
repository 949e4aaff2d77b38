"""One rank of the DP-attention + EP model test (started by tests/dist/test_dp_ep_model.py).

    python dp_ep_worker.py SPEC_JSON OUT_DIR RANK WORLD STORE_FILE    (CPU: gloo over a file store)

Joins the world, then for every case loads the checkpoint with `dp_ep_layout` (experts split over
the world, MoE layers through DispatchCombine), plays this rank's part of the shared step script
(`dp_script`: its own sequences; an idle step when it has none) and writes the logits of its
active steps to OUT_DIR/<case>.rank<R>.safetensors (raw tensors, no pickle)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from nvl72.config import ModelConfig
from nvl72.model.dp_ep import dp_ep_layout, idle_forward
from nvl72.model.loader import load_model
from tests.model.tiny import PagedRunner

TIMEOUT_S = 30.0
MAX_TOKENS_PER_RANK = 64


def dp_script(model, steps: list[dict], rank: int) -> torch.Tensor:
    """Run rank `rank`'s chunks of every step ({"chunks": per rank [(seq_id, tokens)], "mtp": bool});
    with "mtp", also an MTP draft from the step's hidden states (input: each token + 1). A step
    without chunks for this rank is an idle forward on a DP+EP model (skipped on a single-rank
    one). Returns the logits of the active steps, concatenated [T, V]."""
    run = PagedRunner(model, seed=3 + rank)
    out = []
    for step in steps:
        chunks = [(sid, toks) for sid, toks in step["chunks"][rank]]
        if not chunks:
            if model.parallel.dispatch is not None:
                idle_forward(model)
                if step["mtp"]:
                    idle_forward(model, mtp_step=0)
            continue
        batch = run.batch(chunks)
        hidden = model(batch, run.caches)  # [T, H]
        out.append(model.compute_logits(hidden))
        if step["mtp"]:
            drafts = dataclasses.replace(batch, input_ids=(batch.input_ids + 1) % model.config.vocab_size)
            out.append(model.compute_logits(model.forward_mtp(drafts, run.caches, hidden)))
    return torch.cat(out)


def main(spec_json: str, out_dir: str, rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    with open(spec_json) as f:
        spec = json.load(f)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        for case in spec["cases"]:
            config = ModelConfig.from_pretrained(case["path"])
            layout = dp_ep_layout(dist.group.WORLD, config, MAX_TOKENS_PER_RANK, torch.float32, TIMEOUT_S)
            model = load_model(case["path"], dtype=torch.float32, device="cpu", parallel=layout)
            with torch.no_grad():
                logits = dp_script(model, case["steps"], rank)
            save_file({"logits": logits.contiguous()}, f"{out_dir}/{case['name']}.rank{rank}.safetensors")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
