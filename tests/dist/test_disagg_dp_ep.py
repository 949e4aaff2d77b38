"""A DP-attention + EP decode instance in disaggregated serving, `mpiexec -n 3` on CPU (gloo):
prefill TP1 on rank 0 (beside the HTTP front), one decode instance over ranks 1 and 2 (DP2/EP2:
each rank takes its own requests, experts split over both, MoE layers through DispatchCombine,
passes in lockstep by PassSync). Concurrent streamed greedy completions through the openai client
equal the same front over one single-process engine on the same transformers checkpoint, with
requests decoded on both ranks (qwen3_moe; qwen3_next with MTP drafts, so the ranks run different
numbers of passes per step). A DP rank killed mid-decode takes the instance down cleanly: both
streams end with errors (the front's 503, the survivor's failed collective) and the front marks
both ranks dead."""
import re

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
        got = launch.complete_concurrently(prompts, max_tokens)
        # Alone on one DP rank: the other has nothing and joins its passes idle.
        alone = launch.complete(prompts[0], max_tokens)
    finally:
        launch.close()
    log = launch.log_text
    assert got == _reference(ckpt, prompts, max_tokens, **engine_kw), log[-4000:]
    assert alone == got[0]
    assert all(n == max_tokens and text for text, n in got)
    # Every request went prefill -> transfer -> one of the instance's two DP ranks, both used.
    assert "prefill rank 0: 7 requests handed off" in log, log
    received = {int(r): int(n) for r, n in re.findall(r"decode rank ([12]): (\d+) requests received", log)}
    assert sorted(received) == [1, 2] and sum(received.values()) == 7 and min(received.values()) >= 1, log
    idle = {int(r): int(n) for r, n in re.findall(r"decode rank ([12]): DP\+EP, (\d+) idle passes", log)}
    assert sorted(idle) == [1, 2] and max(idle.values()) >= max_tokens - 1, log  # >= 1 per lone decode step
    assert "KV transfer failed" not in log and "did not complete" not in log and "failed on rank" not in log


@pytest.mark.mp
@pytest.mark.timeout(120)
def test_lost_dp_rank_fails_the_instance_streams_and_front_marks_both_dead(tmp_path):
    """SIGKILL rank 2 mid-decode: its stream ends with the front's 503; rank 1's next collective
    fails (a peer gone, or the 20 s collective timeout), so its stream ends with the instance's
    error naming the failure; both ranks are then dead to the front (later requests: 503)."""
    import time

    import openai

    ckpt = write_checkpoint(tmp_path, "ckpt", "qwen3_moe", dict(num_key_value_heads=2, vocab_size=VOCAB),
                            fused=False)
    launch = Launch(tmp_path, "qwen3_moe", lost_timeout=1.5, plan_args=DPEP, model_dir=ckpt, load_format="auto",
                    max_model_len=1024, page_size=16, num_pages=200)
    try:
        # one stream per DP rank; past the prefill rank's first token (3 chunks): decoding on its DP rank
        results, took = launch.kill_rank_mid_streams(2, _prompts(2), after_chunks=3, join_s=40)
        assert [r[0] for r in results] == ["error", "error"], (results, launch.tail())
        errors = " | ".join(r[1] for r in results)
        assert "rank 2 lost" in errors, errors  # the front's 503 for the killed rank's stream
        assert "decode instance decode[0] failed on rank 1" in errors, errors  # the survivor's own error
        assert took < 30
        deadline = time.monotonic() + 10
        while True:  # rank 1 left after failing its streams: no load reports, dead to the front
            try:
                launch.complete(_prompts(1)[0], 4)
            except openai.APIError as e:
                if "no live rank" in str(e):
                    break
            assert time.monotonic() < deadline, launch.tail()
            time.sleep(0.2)
    finally:
        launch.close()


class _FailingSync:
    """A PassSync whose collective fails (as when a peer rank is gone)."""

    def before(self, kind: int) -> None:
        from nvl72.parallel import CollectiveTimeout

        raise CollectiveTimeout(f"DP+EP pass agreement for pass {kind} did not complete within 1 s")

    def finish(self) -> None:
        pass


def test_engine_hooks_dp_ep_errors_are_fatal_plain_errors_fail_the_step(tmp_path):
    """In one gloo world of 1: a DP+EP engine raises a failed pass agreement out of `step` (its EP
    group is out of step); a plain engine fails only that step's requests; `set_pass_sync` refuses
    an engine without a dispatch by name."""
    import datetime

    import torch
    import torch.distributed as dist

    from nvl72.config import ModelConfig
    from nvl72.engine.core import build_engine
    from nvl72.engine.protocol import AddRequest, SamplingParams
    from nvl72.model.dp_ep import dp_ep_layout
    from nvl72.parallel import CollectiveTimeout

    ckpt = write_checkpoint(tmp_path, "ckpt", "qwen3_moe", dict(num_key_value_heads=2), fused=False)
    kw = dict(model=str(ckpt), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, page_size=4, num_pages=64)
    req = AddRequest("r0", [3, 1, 4, 1, 5], SamplingParams(max_tokens=4, temperature=0.0))
    plain = build_engine(**kw)
    with pytest.raises(ValueError, match="set_pass_sync needs a DP\\+EP model"):
        plain.set_pass_sync(_FailingSync())
    plain.runner.sync = _FailingSync()
    plain.add_request(req)
    outs = plain.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r0", "error")] and "CollectiveTimeout" in outs[0].error
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    try:
        layout = dp_ep_layout(dist.group.WORLD, ModelConfig.from_pretrained(str(ckpt)), 32, torch.float32, 20.0)
        eng = build_engine(**kw, parallel=layout)
        assert eng.dp_ep and eng.runner.graphs is None
        eng.set_pass_sync(_FailingSync())
        eng.add_request(req)
        with pytest.raises(CollectiveTimeout, match="pass 0"):
            eng.step()
    finally:
        dist.destroy_process_group()
