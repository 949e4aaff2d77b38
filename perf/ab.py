"""A/B of environment switches on one benchmark command, the settings alternating round by round.

    python3 -m perf.ab default qk_before:NVL72_QK_NORM_ATTN=0 --rounds 2 [--json FILE] [-- COMMAND ...]

Why alternate: a GPU's speed drifts within a session (clocks, other tenants of a shared host), so each
setting runs once a round, in turn, and the table shows every round beside the others, as
perf/RESULTS.md records A/Bs. A setting is NAME or NAME:VAR=VALUE[,VAR=VALUE...]. The command (after
`--`; default: perf.serve's batch-1 line, `DEFAULT_COMMAND`) runs once a setting and round with those
variables set and `--json FILE` appended; the first row of that JSON whose `what` is `--row`
(perf.serve's "decode b=1") gives the run's `step_ms` and the spread of its `step_ms_runs`. A run that fails or
outlives `--timeout` is reported with the tail of its output and the others still run (exit status 1).
Prints the table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

DEFAULT_COMMAND = [sys.executable, "-m", "perf.serve", "--layers", "48", "--modes", "graphs", "--no-ttft",
                   "--decode-out", "64", "--graph-batch-sizes", "1", "--batches", "1"]


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    env: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> "Setting":
        name, _, assigns = text.partition(":")
        if not name:
            raise ValueError(f"setting {text!r}: no name (NAME or NAME:VAR=VALUE[,VAR=VALUE...])")
        env = {}
        for a in filter(None, assigns.split(",")):
            var, eq, val = a.partition("=")
            if not eq or not var:
                raise ValueError(f"setting {text!r}: {a!r} is not VAR=VALUE")
            env[var] = val
        return cls(name, env)

    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.env.items()) or "-"


def run_once(command: list[str], env: dict[str, str], row: str, timeout: float) -> dict:
    """One run: {"step_ms", "runs"} from its JSON's row, or {"error", "tail"}. The command runs in its
    own session, killed whole when it outlives `timeout`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        p = subprocess.Popen(command + ["--json", out], env={**os.environ, **env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            text, _ = p.communicate()
            return {"error": f"timed out after {timeout:g} s", "tail": text[-2000:]}
        if p.returncode:
            return {"error": f"exit status {p.returncode}", "tail": text[-2000:]}
        try:
            with open(out) as f:
                rows = [r for r in json.load(f).get("rows", []) if r.get("what") == row and "step_ms" in r]
        except (OSError, ValueError) as e:
            return {"error": f"no readable --json output ({e})", "tail": text[-2000:]}
        if not rows:
            return {"error": f"no {row!r} row with step_ms in its --json output", "tail": text[-2000:]}
        return {"step_ms": rows[0]["step_ms"], "runs": rows[0].get("step_ms_runs") or [rows[0]["step_ms"]]}


def cell(r: dict) -> str:
    if "error" in r:
        return r["error"]
    lo, hi = min(r["runs"]), max(r["runs"])
    return f"{r['step_ms']:.3f} ({lo:.3f}-{hi:.3f})" if len(r["runs"]) > 1 else f"{r['step_ms']:.3f}"


def table(settings: list[Setting], results: dict[str, list[dict]], rounds: int) -> list[str]:
    """The A/B table: a setting a line, its rounds, the median over them, and against the first setting."""
    med = {}
    for s in settings:
        ok = [r["step_ms"] for r in results[s.name] if "error" not in r]
        med[s.name] = statistics.median(ok) if ok else None
    base = med[settings[0].name]
    head = ["setting", "env"] + [f"round {i + 1} ms" for i in range(rounds)] + ["median ms", "vs first"]
    rows = [head]
    for s in settings:
        m = med[s.name]
        vs = f"{100 * (m / base - 1):+.1f}%" if m is not None and base else "-"
        rows.append([s.name, s.label()] + [cell(r) for r in results[s.name]] + [f"{m:.3f}" if m else "-", vs])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = DEFAULT_COMMAND
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
        if not command:
            print("perf.ab: nothing after `--` (the benchmark command)", file=sys.stderr)
            return 2
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("settings", nargs="+", help="NAME or NAME:VAR=VALUE[,VAR=VALUE...]")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--row", default="decode b=1", help="the `what` of the JSON rows to compare")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    ap.add_argument("--json", default=None, help="write the settings and every run's result here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds}: at least 1")
    if args.timeout <= 0:
        ap.error(f"--timeout={args.timeout}: must be positive")
    try:
        settings = [Setting.parse(t) for t in args.settings]
    except ValueError as e:
        ap.error(str(e))
    names = [s.name for s in settings]
    if len(set(names)) != len(names):
        ap.error(f"setting names repeat: {', '.join(names)}")
    results: dict[str, list[dict]] = {s.name: [] for s in settings}
    for rnd in range(args.rounds):
        for s in settings:
            r = run_once(command, s.env, args.row, args.timeout)
            results[s.name].append(r)
            print(f"round {rnd + 1} {s.name}: {cell(r)}", flush=True)
            if "error" in r:
                print(r["tail"], flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"command": command, "row": args.row,
                       "settings": [dataclasses.asdict(s) for s in settings], "results": results}, f, indent=1)
    print(f"\nAB {args.row!r}, {args.rounds} round(s), settings alternating: {' '.join(command)}")
    print("\n".join(table(settings, results, args.rounds)))
    return 1 if any("error" in r for rs in results.values() for r in rs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
