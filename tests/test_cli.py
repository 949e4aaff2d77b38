import subprocess
import sys

import pytest

from nvl72.cli import COMMANDS, build_parser, main


def test_every_command_has_help():
    parser = build_parser()
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([name, "--help"])
        assert e.value.code == 0


def test_unknown_log_level_names_the_value(capsys):
    with pytest.raises(SystemExit):
        main(["--log-level", "LOUD", "plan"])
    assert "LOUD" in capsys.readouterr().err


def test_console_entry_runs():
    out = subprocess.run([sys.executable, "-m", "nvl72", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "serve" in out.stdout
