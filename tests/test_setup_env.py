"""scripts/setup_env.sh (what the two commands run first) stops with a clear message when its
virtual environment's Python is too old for JAX, instead of pip's "no matching distribution"."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_too_old_python_is_a_clear_error(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # A stand-in for Python 3.10: reports its version, fails the version check.
    python.write_text('#!/bin/sh\n'
                      '[ "$1" = --version ] && echo "Python 3.10.12" && exit 0\n'
                      'exit 1\n')
    python.chmod(0o755)
    env = dict(os.environ, SPRNN_VENV=str(tmp_path / "venv"))
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_env.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "needs Python >= 3.11" in done.stderr and "Python 3.10.12" in done.stderr
    assert "installing" not in done.stdout  # stopped before pip
