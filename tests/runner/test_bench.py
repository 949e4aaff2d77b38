"""`nvl72 bench`: workload generators, metric arithmetic, and a short run against the real server
(embedded tiny preset, CPU engine thread) through the CLI."""
import asyncio
import json
import random

import pytest

from nvl72.cli import main
from nvl72.commands import bench as B


def test_workloads_shapes_and_prefix_structure():
    rng = random.Random(0)
    fixed = B.fixed_workload(5, 7, rng, (10, 20))
    assert len(fixed) == 5 and all(len(p) == 7 and all(10 <= t < 20 for t in p) for p in fixed)
    convs = B.agentic_workload(3, 4, 50, 8, rng, (10, 20))
    assert len(convs) == 3
    for turns in convs:
        assert [len(t) for t in turns] == [50, 58, 66, 74]
        assert all(turns[i + 1][: len(turns[i])] == turns[i] for i in range(3))
    assert convs[0][0] != convs[1][0]
    with pytest.raises(ValueError, match="turns=0"):
        B.agentic_workload(1, 0, 5, 1, rng, (1, 2))
    with pytest.raises(ValueError, match="input_len=0"):
        B.fixed_workload(1, 0, rng, (1, 2))


METRICS_TEXT = """# HELP nvl72:prefix_cache_queries_total prompt tokens looked up
# TYPE nvl72:prefix_cache_queries_total counter
nvl72:prefix_cache_queries_total{model_name="m"} 400.0
nvl72:prefix_cache_queries_created{model_name="m"} 1.7e9
# TYPE nvl72:prefix_cache_hits_total counter
nvl72:prefix_cache_hits_total{model_name="m"} 96.0
# TYPE nvl72:spec_decode_num_draft_tokens counter
nvl72:spec_decode_num_draft_tokens_total{model_name="m"} 30.0
nvl72:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0
nvl72:num_steps_total{model_name="m"} 50.0
nvl72:step_seconds_total{model_name="m"} 0.2
nvl72:num_eager_steps_total{model_name="m"} 20.0
nvl72:eager_step_seconds_total{model_name="m"} 0.15
nvl72:num_step_periods_total{model_name="m"} 45.0
nvl72:step_period_seconds_total{model_name="m"} 0.3
nvl72:device_wait_seconds_total{model_name="m"} 0.06
nvl72:triton_compiles_total{model_name="m"} 3.0
"""


def test_metric_parsing_and_rates():
    m = B.parse_metrics(METRICS_TEXT)
    assert m == {"prefix_queries": 400.0, "prefix_hits": 96.0, "spec_drafted": 30.0, "spec_accepted": 12.0,
                 "engine_steps": 50.0, "engine_step_seconds": 0.2, "engine_eager_steps": 20.0,
                 "engine_eager_step_seconds": 0.15, "engine_periods": 45.0, "engine_period_seconds": 0.3,
                 "engine_wait_seconds": 0.06,
                 "engine_triton_compiles": 3.0}
    before = dict(prefix_queries=100.0, prefix_hits=16.0, spec_drafted=10.0, spec_accepted=2.0, engine_steps=10.0,
                  engine_step_seconds=0.1, engine_eager_steps=10.0, engine_eager_step_seconds=0.1,
                  engine_periods=5.0, engine_period_seconds=0.18, engine_wait_seconds=0.02, engine_triton_compiles=1.0)
    r = B.metric_rates(before, m)
    assert r["prefix_cache_hit_rate"] == pytest.approx(80 / 300) and r["mtp_acceptance"] == pytest.approx(0.5)
    assert r["engine_steps"] == 40 and r["engine_step_ms"] == pytest.approx(2.5)
    assert r["engine_eager_steps"] == 10 and r["engine_eager_step_ms"] == pytest.approx(5.0)
    assert r["engine_period_ms"] == pytest.approx(3.0) and r["engine_wait_ms"] == pytest.approx(1.0)
    assert r["engine_triton_compiles"] == 2
    assert B.metric_rates(m, m) == {"prefix_cache_hit_rate": None, "mtp_acceptance": None, "engine_steps": None,
                                    "engine_step_ms": None, "engine_eager_steps": None, "engine_eager_step_ms": None,
                                    "engine_period_ms": None, "engine_wait_ms": None, "engine_triton_compiles": None}


def test_summary_arithmetic_counts_tokens_not_chunks():
    res = [B.RequestResult(100, 11, 32, 0.5, 1.5, chunks=4), B.RequestResult(50, 5, 0, 0.1, 0.5, chunks=5),
           B.RequestResult(20, 1, 0, 0.2, 0.2, chunks=1)]
    s = B.summarize("fixed", 2, res, 2.0, {"prefix_cache_hit_rate": 0.25})
    assert s.output_tokens == 17 and s.output_tok_s == pytest.approx(8.5) and s.request_per_s == pytest.approx(1.5)
    assert s.ttft_ms["median"] == pytest.approx(200.0)
    assert s.tpot_ms["mean"] == pytest.approx((100.0 + 100.0) / 2)  # (1.5-0.5)/10 and (0.5-0.1)/4; 1-token run has none
    assert s.usage_cached_fraction == pytest.approx(32 / 170)
    assert "fixed" in B.table([s]) and "0.250" in B.table([s])


def test_bad_cli_values_name_them(capsys):
    assert main(["bench", "--concurrency", "1,x"]) == 2
    assert "--concurrency: '1,x'" in capsys.readouterr().err
    assert main(["bench", "--token-range", "5:5"]) == 2
    assert "--token-range" in capsys.readouterr().err


def test_plot_path_that_is_a_file_is_refused_before_the_run(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("x")
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--plot", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"--plot: '{f}' is not a directory" in err and "127.0.0.1:9" not in err


def test_unreachable_server_is_a_cli_error(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--model", "m", "--workload", "fixed",
                 "--concurrency", "1", "--num-prompts", "1", "--input-len", "4", "--output-len", "2",
                 "--timeout", "5"]) == 2
    assert "http://127.0.0.1:9" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server():
    from nvl72.commands.serve import load_tokenizer
    from nvl72.engine.client import start_local_engine
    from nvl72.presets import DEFAULT_MODEL_NAME
    from nvl72.server.app import ServerConfig, build_app
    from nvl72.server.runner import ServerThread

    eng = start_local_engine(device="cpu", max_model_len=512, max_num_seqs=8)
    try:
        app = build_app(eng, load_tokenizer(None), ServerConfig(served_model_name=DEFAULT_MODEL_NAME))
        with ServerThread(app) as s:
            yield s
    finally:
        asyncio.run(eng.shutdown())


def test_cli_against_real_server(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--base-url", server.url, "--concurrency", "1,3", "--num-prompts", "3", "--input-len", "12",
               "--output-len", "4", "--conversations", "2", "--turns", "3", "--first-turn-len", "40",
               "--turn-len", "16", "--turn-output-len", "3", "--json", str(out), "--timeout", "120",
               "--plot", str(tmp_path / "charts")])
    assert rc == 0
    text = capsys.readouterr().out
    charts = sorted(p.name for p in (tmp_path / "charts").iterdir())
    assert charts == ["agentic_tokens.svg", "agentic_ttft.svg", "fixed_latency.svg", "fixed_throughput.svg"]
    assert "charts: " in text
    assert "agentic" in text and "TTFT p50 ms" in text
    runs = json.loads(out.read_text())["runs"]
    fixed = [r for r in runs if r["workload"] == "fixed"]
    assert [r["concurrency"] for r in fixed] == [1, 3]
    assert all(r["output_tokens"] == 3 * 4 and r["input_tokens"] == 3 * 12 for r in fixed)
    ag = next(r for r in runs if r["workload"] == "agentic")
    assert ag["num_requests"] == 6 and ag["output_tokens"] == 6 * 3
    assert ag["input_tokens"] == 2 * (40 + 56 + 72)
    # Turns 2 and 3 resend 56 / 72 tokens whose first 40 / 56 were sent before: whole pages hit.
    assert 0 < ag["prefix_cache_hit_rate"] <= (40 + 56) / (40 + 56 + 72)
    assert ag["usage_cached_fraction"] == pytest.approx(ag["prefix_cache_hit_rate"], abs=1e-9)
    assert all(r["ttft_ms"]["median"] > 0 and r["tpot_ms"]["median"] > 0 for r in runs)
    # the engine's own steps over each run: at least one per output token of the longest request
    assert all(r["engine_steps"] >= 4 - 1 and r["engine_step_ms"] > 0 and r["engine_period_ms"] > 0 for r in fixed)
    # no CUDA graphs on a CPU server: every step ran eagerly
    assert all(r["engine_eager_steps"] == r["engine_steps"] and r["engine_eager_step_ms"] > 0 for r in fixed)
    turns = ag["per_turn"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert [t["prompt_tokens"] for t in turns] == [40, 56, 72]
    assert turns[0]["cached_fraction"] == 0 and turns[0]["new_tokens"] == 40
    # Later turns: at most the 16 new tokens plus the partial page before them are recomputed.
    assert all(t["cached_fraction"] > 0 and t["new_tokens"] < t["prompt_tokens"] for t in turns[1:])
    assert "turn" in text and "new tok" in text
