"""The code keeps its style by itself: ruff's linter and formatter (settings in pyproject.toml) pass on every
Python file of the package, tests, benchmarks and examples."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ["megatron_taco", "tests", "benchmarks", "examples"]
RUFF = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")

pytestmark = pytest.mark.skipif(
    RUFF is None, reason="needs ruff (pip install -e '.[dev]'; scripts/run_tests.sh installs it)"
)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    proc = subprocess.run([RUFF, *command, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff {' '.join(command)} found:\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}"
