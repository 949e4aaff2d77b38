"""`nvl72 bench --plot DIR`: a run's figures as SVG line charts, written without a plotting library
(serving hosts carry none): output tokens/s and TTFT / TPOT against concurrency for the fixed
workload; TTFT and prompt tokens (all of them, and the new ones the prefix cache did not hold) by
turn for the agentic one, so a reader sees whether turn-2+ TTFT follows the new tokens or the
context."""
from __future__ import annotations

import math
import os
from xml.sax.saxutils import escape

W, H, PAD = 640, 400, 64
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values covering [lo, hi]."""
    step = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(step))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= step)
    return [i * step for i in range(math.floor(lo / step), math.ceil(hi / step) + 1)]


def line_chart(title: str, x_label: str, y_label: str, series: dict[str, list[tuple[float, float]]],
               log_x: bool = False) -> str:
    """An SVG line chart of `series` ({name: [(x, y), ...]}); the y axis starts at 0 (or the lowest y
    below it); `log_x` spaces x by log2 (concurrencies 1, 4, 16, 64). Ticks: the data's x values, round
    y values."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        raise ValueError(f"{title}: no points to plot")
    if log_x and min(x for x, _ in pts) <= 0:
        raise ValueError(f"{title}: a log x axis needs x > 0")
    fx = math.log2 if log_x else float
    x0, x1 = min(fx(x) for x, _ in pts), max(fx(x) for x, _ in pts)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    yt = _ticks(min(0.0, min(y for _, y in pts)), max(max(y for _, y in pts), 1e-9))
    y0, y1 = yt[0], yt[-1]

    def sx(x):
        return PAD + (fx(x) - x0) / (x1 - x0) * (W - 2 * PAD)

    def sy(y):
        return H - PAD - (y - y0) / (y1 - y0) * (H - 2 * PAD)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="{PAD / 2}" text-anchor="middle" font-size="15">{escape(title)}</text>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 16}" text-anchor="middle">{escape(x_label)}</text>',
           f'<text x="16" y="{H / 2}" text-anchor="middle" transform="rotate(-90 16 {H / 2})">{escape(y_label)}</text>']
    for x in sorted({x for x, _ in pts}):
        out.append(f'<text x="{sx(x):.1f}" y="{H - PAD + 16}" text-anchor="middle">{x:g}</text>')
    for y in yt:
        out.append(f'<line x1="{PAD}" y1="{sy(y):.1f}" x2="{W - PAD}" y2="{sy(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{PAD - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for i, (name, s) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        xy = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(s))
        out.append(f'<polyline class="series" data-name="{escape(name)}" points="{xy}" fill="none" '
                   f'stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>' for x, y in s]
        out.append(f'<text x="{W - PAD - 4}" y="{PAD + 16 * (i + 1)}" text-anchor="end" fill="{color}">'
                   f'{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def plot_dir_problem(out_dir: str) -> str | None:
    """Why `out_dir` cannot take the charts (checked before a run, not after it), or None."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return f"--plot: {out_dir!r} is not a directory"
    return None


def _write(out_dir: str, name: str, svg: str) -> str:
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        f.write(svg)
    return path


def write_plots(runs: list, out_dir: str) -> list[str]:
    """The charts of `runs` (nvl72.commands.bench.RunSummary) into `out_dir` (made if missing); the
    paths written. Fixed-workload charts need runs at two or more concurrencies."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    fixed = sorted((r for r in runs if r.workload == "fixed"), key=lambda r: r.concurrency)
    if len({r.concurrency for r in fixed}) > 1:
        cs = [r.concurrency for r in fixed]
        log_x = cs[-1] / cs[0] >= 4
        paths.append(_write(out_dir, "fixed_throughput.svg", line_chart(
            "output tokens/s by concurrency", "concurrency", "output tok/s",
            {"output tok/s": [(r.concurrency, r.output_tok_s) for r in fixed]}, log_x)))
        lat = {f"{what} p50": [(r.concurrency, getattr(r, key)["median"]) for r in fixed
                               if getattr(r, key)["median"] is not None]
               for what, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))}
        paths.append(_write(out_dir, "fixed_latency.svg", line_chart(
            "latency by concurrency", "concurrency", "ms", {k: v for k, v in lat.items() if v}, log_x)))
    for i, r in enumerate(r for r in runs if r.workload == "agentic" and r.per_turn):
        tag = "" if i == 0 else f"_{i + 1}"
        turns = r.per_turn
        paths.append(_write(out_dir, f"agentic_ttft{tag}.svg", line_chart(
            f"agentic: TTFT by turn ({r.concurrency} conversations)", "turn", "TTFT ms",
            {"TTFT": [(t["turn"], t["ttft_ms"]) for t in turns]})))
        paths.append(_write(out_dir, f"agentic_tokens{tag}.svg", line_chart(
            "agentic: prompt tokens by turn", "turn", "tokens",
            {"prompt": [(t["turn"], t["prompt_tokens"]) for t in turns],
             "new (not cached)": [(t["turn"], t["new_tokens"]) for t in turns]})))
    return paths
