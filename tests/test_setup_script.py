""".ci/setup-venv (sourced by scripts/plan.sh and .ci/run): one line per
step on stderr, pip's output kept out of sight unless a step fails. Run
against a stand-in Python whose venv and pip only record their calls."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in interpreter: "-m venv DIR" makes DIR/bin/{activate,python}
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  printf 'PATH="%s/bin:$PATH"\\n' "$3" > "$3/bin/activate"
  cp "$0" "$3/bin/python"
  exit 0
fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "pip chatter $*"
  echo "WARNING: a pip warning" >&2
  case "$*" in *"${FAIL_ON:-never}"*) echo "ERROR: no such wheel" >&2; exit 1 ;; esac
  exit 0
fi
[ "$1" = -c ] && echo "torch 2.13.0+cpu"
"""


def _run(tmp_path, **env):
    fake = tmp_path / "python-stub"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    command = f"cd {ROOT} && . .ci/setup-venv && echo sourced"
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": str(fake), "VENV": str(venv),
                               "FRESH_VENV": "1", **env})


def test_each_step_is_one_line_and_pip_stays_quiet(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "sourced\n"
    lines = done.stderr.splitlines()
    assert [line.split(":")[0] for line in lines] == ["setup-venv"] * 4, lines
    assert "creating" in lines[0] and "torch==2.13.0" in lines[1]
    assert "warpsplitk" in lines[2] and lines[3] == "setup-venv: ready, torch 2.13.0+cpu"
    assert "pip chatter" in (tmp_path / "venv" / "setup.log").read_text()


def test_a_failing_step_shows_pips_output(tmp_path):
    done = _run(tmp_path, FAIL_ON="-e")
    assert done.returncode != 0 and "sourced" not in done.stdout
    assert "ERROR: no such wheel" in done.stderr
    assert "ready" not in done.stderr
