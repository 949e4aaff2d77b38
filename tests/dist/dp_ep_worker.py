"""One rank of the DP-attention + EP model test (started by tests/dist/test_dp_ep_model.py).

    python dp_ep_worker.py SPEC_JSON OUT_DIR RANK WORLD STORE_FILE    (CPU: gloo over a file store)

Joins the world, then for every case loads the checkpoint with `dp_ep_layout` (experts split over
the world, MoE layers through DispatchCombine), plays this rank's part of the shared step script
(`dp_script`: its own sequences; an idle step when it has none; with "sync", the ranks'
passes are matched by `PassSync`, so their MTP draft counts may differ) and writes the logits of its
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
from nvl72.model.dp_ep import MAIN_PASS, PassSync, dp_ep_layout, idle_forward, mtp_pass
from nvl72.model.loader import load_model
from tests.model.tiny import PagedRunner

TIMEOUT_S = 30.0
MAX_TOKENS_PER_RANK = 64


def dp_script(model, steps: list[dict], rank: int, sync: PassSync | None = None) -> torch.Tensor:
    """Run rank `rank`'s part of every step ({"chunks": per rank [(seq_id, tokens)], "mtp": per
    rank the number of chained MTP drafts after the forward, input: each token + 1). A step without
    chunks for this rank is idle: on a DP+EP model an idle forward (and idle MTP passes), or, with
    `sync`, whatever passes the other ranks run (`PassSync`; then the MTP counts may differ by
    rank). A single-rank model skips it. Returns the logits of the active steps, concatenated [T, V]."""
    run = PagedRunner(model, seed=3 + rank)
    out = []
    for step in steps:
        chunks = [(sid, toks) for sid, toks in step["chunks"][rank]]
        num_mtp = step["mtp"][rank] if chunks else max(step["mtp"])
        if chunks:
            batch = run.batch(chunks)
            if sync is not None:
                sync.before(MAIN_PASS)
            hidden = model(batch, run.caches)  # [T, H]
            out.append(model.compute_logits(hidden))
            drafts = dataclasses.replace(batch, input_ids=(batch.input_ids + 1) % model.config.vocab_size)
            for _ in range(num_mtp):  # chained drafts over the same positions
                if sync is not None:
                    sync.before(mtp_pass(0))
                hidden = model.forward_mtp(drafts, run.caches, hidden)
                out.append(model.compute_logits(hidden))
        elif sync is None and model.parallel.dispatch is not None:
            idle_forward(model)
            for _ in range(num_mtp):
                idle_forward(model, mtp_step=0)
        if sync is not None:
            sync.finish()
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
            sync = PassSync(model, dist.group.WORLD, TIMEOUT_S) if case.get("sync") else None
            with torch.no_grad():
                logits = dp_script(model, case["steps"], rank, sync)
            if sync is not None:
                print(f"{case['name']}: rank {rank} ran {sync.idle_passes} idle passes", flush=True)
            save_file({"logits": logits.contiguous()}, f"{out_dir}/{case['name']}.rank{rank}.safetensors")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
