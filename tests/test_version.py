"""`megatron-alp --version` prints the version pyproject.toml declares (its one source)."""

import re
import subprocess
import sys
from pathlib import Path

from megatron_alp.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_pyproject_version(capsys):
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"megatron-alp {declared}\n"
    proc = subprocess.run([sys.executable, "-m", "megatron_alp.cli", "--version"], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout) == (0, f"megatron-alp {declared}\n"), proc.stderr
