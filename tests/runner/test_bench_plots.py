"""`nvl72 bench --plot`'s SVG charts: the points land where their values say, and each workload gets
its charts."""
import xml.etree.ElementTree as ET

import pytest

from nvl72.commands import bench as B
from nvl72.commands.bench_plots import H, PAD, W, line_chart, write_plots

NS = "{http://www.w3.org/2000/svg}"


def _series(svg: str) -> dict[str, list[tuple[float, float]]]:
    root = ET.fromstring(svg)
    return {p.get("data-name"): [tuple(float(v) for v in xy.split(",")) for xy in p.get("points").split()]
            for p in root.iter(NS + "polyline")}


def test_points_map_linearly_inside_the_plot_area():
    svg = line_chart("t <&>", "x", "y", {"a": [(3, 30.0), (1, 10.0), (2, 20.0)], "b <x>": [(1, 5.0), (3, 0.0)]})
    got = _series(svg)  # also: the escaped title and names parse
    assert set(got) == {"a", "b <x>"}
    a = got["a"]
    assert [x for x, _ in a] == sorted(x for x, _ in a)  # drawn in x order
    xs, ys = [x for x, _ in a], [y for _, y in a]
    px = pytest.approx  # pixel coordinates are written to 0.1
    assert xs[1] - xs[0] == px(xs[2] - xs[1], abs=0.11) and ys[0] - ys[1] == px(ys[1] - ys[2], abs=0.11)
    assert ys[0] > ys[1] > ys[2]  # larger values higher up
    assert got["b <x>"][1][1] == pytest.approx(H - PAD)  # y = 0 on the x axis (the axis starts at 0)
    assert all(PAD <= x <= W - PAD and PAD <= y <= H - PAD for s in got.values() for x, y in s)


def test_log_x_spaces_concurrencies_evenly_and_needs_positive_x():
    xs = [x for x, _ in _series(line_chart("t", "c", "v", {"s": [(1, 1.0), (4, 2.0), (16, 3.0), (64, 4.0)]},
                                           log_x=True))["s"]]
    steps = [b - a for a, b in zip(xs, xs[1:])]
    assert steps == pytest.approx([steps[0]] * 3, abs=0.11)
    with pytest.raises(ValueError, match="x > 0"):
        line_chart("t", "c", "v", {"s": [(0, 1.0)]}, log_x=True)
    with pytest.raises(ValueError, match="no points"):
        line_chart("t", "c", "v", {"s": []})


def _run(workload, c, tok_s, ttft, tpot, per_turn=None):
    return B.RunSummary(workload, c, 2 * c, 1.0, 10, 10, tok_s, 1.0, {"median": ttft}, {"median": tpot},
                        per_turn=per_turn)


def test_write_plots_per_workload(tmp_path):
    turns = [{"turn": t, "prompt_tokens": 100.0 * t, "new_tokens": 100.0 if t == 1 else 20.0,
              "cached_fraction": 0.0, "ttft_ms": 50.0 if t == 1 else 12.0} for t in (1, 2, 3)]
    runs = [_run("fixed", 4, 300.0, 20.0, 3.0), _run("fixed", 1, 100.0, 10.0, None),
            _run("agentic", 2, 50.0, 30.0, 2.0, turns)]
    paths = write_plots(runs, str(tmp_path / "new"))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["agentic_tokens.svg", "agentic_ttft.svg",
                                                          "fixed_latency.svg", "fixed_throughput.svg"]
    lat = _series((tmp_path / "new" / "fixed_latency.svg").read_text())
    assert len(lat["TTFT p50"]) == 2 and len(lat["TPOT p50"]) == 1  # a missing TPOT is left out
    tok = _series((tmp_path / "new" / "agentic_tokens.svg").read_text())
    assert len(tok["prompt"]) == len(tok["new (not cached)"]) == 3
    assert write_plots(runs[:1], str(tmp_path / "one")) == []  # one concurrency: nothing to draw against
