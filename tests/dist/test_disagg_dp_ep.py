"""A DP-attention + EP decode instance in disaggregated serving, `mpiexec -n 3` on CPU (gloo):
prefill TP1 on rank 0 (beside the HTTP front), one decode instance over ranks 1 and 2 (DP2/EP2:
each rank takes its own requests, experts split over both, MoE layers through DispatchCombine,
passes in lockstep by PassSync). Concurrent streamed greedy completions through the openai client
equal the same front over one single-process engine on the same transformers checkpoint, with
requests decoded on both ranks (qwen3_moe; qwen3_next with MTP drafts, so the ranks run different
numbers of passes per step)."""
import re
import threading

import pytest

from tests.dist.test_disagg_serving import VOCAB, Launch, _prompts, _reference
from tests.dist.test_tp_model import write_checkpoint

DPEP = ["--rack", "cpu:3", "--model", "Qwen3-30B-A3B", "--prefill-tp", "1", "--decode-size", "2",
        "--prefill-instances", "1", "--decode-instances", "1"]
# family -> (checkpoint overrides, MTP head, engine arguments beyond the defaults)
CASES = {
    "qwen3_moe": (dict(num_key_value_heads=2), False, {}),
    "qwen3_next": (dict(num_key_value_heads=2), True, dict(num_speculative_tokens=2)),
}


@pytest.mark.mp
@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", list(CASES))
def test_dp_ep_decode_instance_http_stream_equals_single_process(tmp_path, family):
    overrides, mtp, engine_kw = CASES[family]
    ckpt = write_checkpoint(tmp_path, "ckpt", family, dict(overrides, vocab_size=VOCAB), fused=False, mtp=mtp)
    engine_kw = dict(engine_kw, load_format="auto")
    prompts, max_tokens = _prompts(6), 8
    launch = Launch(tmp_path, family, plan_args=DPEP, model_dir=ckpt, **engine_kw)
    try:
        got: list = [None] * len(prompts)

        def run(i):
            got[i] = launch.complete(prompts[i], max_tokens)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert all(g is not None for g in got), launch.tail()
    finally:
        launch.close()
    log = launch.log_text
    assert got == _reference(ckpt, prompts, max_tokens, **engine_kw), log[-4000:]
    assert all(n == max_tokens and text for text, n in got)
    # Every request went prefill -> transfer -> one of the instance's two DP ranks, both used.
    assert "prefill rank 0: 6 requests handed off" in log, log
    received = {int(r): int(n) for r, n in re.findall(r"decode rank ([12]): (\d+) requests received", log)}
    assert sorted(received) == [1, 2] and sum(received.values()) == 6 and min(received.values()) >= 1, log
    idle = [int(n) for n in re.findall(r"decode rank [12]: DP\+EP, (\d+) idle passes", log)]
    assert len(idle) == 2 and sum(idle) > 0, log  # a rank with less work joined the other's passes
    assert "KV transfer failed" not in log and "did not complete" not in log and "failed on rank" not in log
