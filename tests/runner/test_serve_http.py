"""perf.serve_http end to end on a CPU: the server child starts, every workload runs over HTTP, the
agentic turns hit the prefix cache, and the child is gone afterwards (the GPU run takes this path)."""
import json

import pytest

from nvl72.parallel import free_port
from perf import serve_http
from tests.engine.tiny import CONFIGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]



def test_serve_http_cpu(tmp_path, capsys):
    cfg = dict(CONFIGS["qwen3_moe"], vocab_size=151936, eos_token_id=[151645])  # the shipped Qwen3 vocabulary
    (tmp_path / "tiny.json").write_text(json.dumps(cfg))
    out = tmp_path / "res.json"
    rc = serve_http.main([
        "--device", "cpu", "--model-config", str(tmp_path / "tiny.json"), "--port", str(free_port("127.0.0.1")),
        "--max-model-len", "512", "--max-num-seqs", "4", "--decode-prompt-len", "16", "--decode-out", "6",
        "--decode-rounds", "1", "--ttft-lens", "32,96", "--ttft-requests", "2", "--conversations", "2",
        "--turns", "3", "--first-turn-len", "64", "--turn-len", "24", "--turn-output-len", "4",
        "--startup-timeout", "120", "--json", str(out), "--log", str(tmp_path / "server.log"),
        "--plot", str(tmp_path / "charts")])
    assert rc == 0
    res = json.loads(out.read_text())
    rows = {r["what"]: r for r in res["rows"]}
    assert rows["decode c=1"]["tok_s"] > 0 and rows["decode c=4"]["tok_s"] > 0
    assert rows["TTFT 32"]["ttft_ms"] > 0 and rows["TTFT 96"]["ttft_ms"] > 0
    dec = res["runs"]["decode"]
    assert dec["4"]["output_tokens"] == 4 * 6 and dec["1"]["num_requests"] == 1
    turns = res["runs"]["agentic"]["per_turn"]
    assert [t["prompt_tokens"] for t in turns] == [64, 88, 112]
    assert turns[0]["cached_fraction"] == 0 and all(t["cached_fraction"] > 0.5 for t in turns[1:])
    text = capsys.readouterr().out
    assert "SERVE_HTTP cpu" in text and "decode c=4" in text
    # the decode runs (c=1, 4) and the agentic run drawn; the TTFT runs are not concurrency points
    assert sorted(p.name for p in (tmp_path / "charts").iterdir()) == [
        "agentic_tokens.svg", "agentic_ttft.svg", "fixed_latency.svg", "fixed_throughput.svg"]


def test_plot_path_that_is_a_file_is_refused_before_the_server_starts(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("x")
    with pytest.raises(SystemExit):
        serve_http.main(["--device", "cpu", "--plot", str(f), "--log", str(tmp_path / "server.log")])
    assert f"--plot: '{f}' is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "server.log").exists()
