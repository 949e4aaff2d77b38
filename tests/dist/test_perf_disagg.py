"""perf.disagg's whole path on CPU (gloo, a toy-width Qwen3-30B-A3B shape, short prompts): peer
send/recv, a colocated `nvl72 serve`, a two-rank `python -m launch` prefill -> decode over HTTP, and
the decode rank's transfer log lines, so the GPU run does not die on a trivial bug."""
import json
import math
import subprocess
import sys

import pytest

from perf.disagg import SHAPES


@pytest.mark.mp
@pytest.mark.slow
@pytest.mark.parametrize("decode_size", [1, 2])
def test_perf_disagg_runs_end_to_end_on_cpu(tmp_path, decode_size):
    """decode_size 2: a DP+EP decode instance of two ranks (requests spread over both)."""
    lens, layers, requests = [37, 90], 2, 2
    out = tmp_path / "disagg.json"
    proc = subprocess.run([sys.executable, "-m", "perf.disagg", "--device", "cpu", "--shape", "tiny", "--layers",
                           str(layers), "--prompt-lens", ",".join(map(str, lens)), "--requests", str(requests),
                           "--kv-cache", "64MiB", "--start-timeout", "40", "--request-timeout", "20",
                           "--peer-timeout", "30", "--out-dir", str(tmp_path / "run"), "--json", str(out),
                           "--decode-size", str(decode_size), "--output-len", "6"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    cfg = SHAPES["tiny"]
    # The decode rank received whole pages: K and V of every layer, fp32 on CPU.
    per_token = layers * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert [r["prompt_len"] for r in res["rows"]] == lens
    for r, n in zip(res["rows"], lens):
        want = math.ceil(n / 16) * 16 * per_token
        assert r["kv_bytes"] == want and r["bytes_by_kind"] == {"kv": want}, r
        assert r["transfer_ms"] > 0 and r["transfer_GBps"] > 0
        assert 0 < r["colocated_ttft_ms"] < r["colocated_second_token_ms"]
        assert 0 < r["disagg_ttft_ms"] < r["disagg_second_token_ms"]
        assert r["greedy_equal"] == requests, r  # fp32 on CPU: the same tokens as the colocated engine
    assert len(res["transfers"]) == len(lens) * (requests + 1)
    assert res["peer"]["backend"] == "gloo" and len(res["peer"]["send_recv"]) == 2
    assert res["rank_exit_codes"] == [0] * (1 + decode_size) and res["device"] == "cpu"
    assert all(len(t) == 6 for n in lens for t in res["disaggregated"][str(n)]["tokens"])
    assert res["kv_transport"] == "sendrecv"  # auto on CPU
    assert proc.stdout.rstrip().splitlines()[-1].split("|")[0].strip() == str(lens[-1])  # the table comes last
