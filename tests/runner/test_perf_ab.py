"""perf.ab on CPU, against a stand-in benchmark that writes perf.serve's JSON rows from its environment."""
import json
import sys

import pytest

from perf import ab
from perf.serve import main as serve_main

FAKE = r'''
import json, os, sys, time
with open(os.environ["AB_LOG"], "a") as f:
    f.write(os.environ.get("AB_NAME", "?") + "\n")
if os.environ.get("AB_EXIT"):
    print("boom"); sys.exit(int(os.environ["AB_EXIT"]))
if os.environ.get("AB_SLEEP"):
    time.sleep(float(os.environ["AB_SLEEP"]))
ms = float(os.environ["AB_MS"])
rows = [{"what": "decode b=64", "step_ms": 99.0}, {"what": "decode b=1", "step_ms": ms, "step_ms_runs": [ms - 0.01, ms, ms + 0.02]}]
with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
    json.dump({"rows": rows}, f)
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE)
    log = tmp_path / "order.log"
    monkeypatch.setenv("AB_LOG", str(log))
    return [sys.executable, str(script)], log


def test_settings_alternate_and_the_table_compares_medians(fake, tmp_path, capsys):
    cmd, log = fake
    out = tmp_path / "ab.json"
    rc = ab.main(["a:AB_NAME=a,AB_MS=2.0", "b:AB_NAME=b,AB_MS=1.8", "--rounds", "3", "--json", str(out), "--", *cmd])
    assert rc == 0
    assert log.read_text().split() == ["a", "b"] * 3  # one run a setting a round, in turn
    text = capsys.readouterr().out
    last = text.splitlines()[-3:]
    assert last[0].split()[:2] == ["setting", "env"]
    assert last[1].startswith("a ") and "2.000 (1.990-2.020)" in last[1] and last[1].endswith("+0.0%")
    assert last[2].startswith("b ") and "AB_NAME=b,AB_MS=1.8" in last[2] and last[2].endswith("-10.0%")
    saved = json.loads(out.read_text())
    assert [s["name"] for s in saved["settings"]] == ["a", "b"]
    assert [r["step_ms"] for r in saved["results"]["b"]] == [1.8, 1.8, 1.8]


def test_failed_and_hung_runs_are_reported_and_the_rest_run(fake, capsys):
    cmd, log = fake
    rc = ab.main(["ok:AB_NAME=ok,AB_MS=1.5", "bad:AB_NAME=bad,AB_EXIT=3", "slow:AB_NAME=slow,AB_SLEEP=30,AB_MS=1",
                  "--rounds", "1", "--timeout", "3", "--", *cmd])
    assert rc == 1
    assert log.read_text().split() == ["ok", "bad", "slow"]
    text = capsys.readouterr().out
    assert "round 1 bad: exit status 3" in text and "boom" in text
    assert "round 1 slow: timed out after 3 s" in text
    assert text.splitlines()[-2].startswith("bad ") and text.splitlines()[-2].split()[-2:] == ["-", "-"]


def test_a_missing_row_is_an_error(fake, capsys):
    cmd, _ = fake
    assert ab.main(["x:AB_MS=1", "--row", "decode b=8", "--", *cmd]) == 1
    assert "no 'decode b=8' row with step_ms" in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [
    (["a:FOO"], "'FOO' is not VAR=VALUE"),
    ([":A=1"], "no name"),
    (["a", "a:X=1"], "setting names repeat"),
    (["a", "--rounds", "0"], "--rounds=0"),
    (["a", "--"], "nothing after"),
])
def test_bad_arguments_name_the_value(argv, msg, capsys):
    try:
        rc = ab.main(argv)
    except SystemExit as e:  # argparse's errors
        rc = e.code
    assert rc == 2 and msg in capsys.readouterr().err


def test_serve_batches_are_checked_before_any_gpu_work(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--batches", "1,0"])
    assert "--batches='1,0'" in capsys.readouterr().err
