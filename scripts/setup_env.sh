#!/usr/bin/env bash
# Creates .venv (once) and builds + installs jax_sprnn into it with the given extras.
# Sourced by scripts/main.sh and scripts/test.sh; safe to run again (rebuilds incrementally).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPRNN_VENV:-$repo/.venv}"
extras="${1:-test}"

if [ ! -x "$venv/bin/python" ]; then
  echo "==> creating virtual environment $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
# JAX >= 0.10 needs Python >= 3.11; pip alone would only say "no matching distribution".
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "jax_sprnn needs Python >= 3.11 (as JAX does); $venv has $("$py" --version 2>&1)." >&2
  echo "Remove it and run again with a newer python3 first on PATH (or set SPRNN_VENV)." >&2
  exit 1
fi
echo "==> installing build tools and runtime dependencies (pip)"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.24" ninja "jax>=0.10"
echo "==> building jax_sprnn (C++ CPU extension; CUDA extension too when nvcc is found)"
start=$(date +%s)
"$py" -m pip install -q --no-build-isolation -C build-dir="$repo/build/venv" "$repo[$extras]"
echo "==> built and installed in $(( $(date +%s) - start )) s"
# From / so that the installed package, not the source tree, is imported.
(cd / && "$py" -c 'import jax_sprnn._ffi as f; print("    CPU extension:", "yes" if f.CPU_TARGETS else "NO", "| CUDA extension:", "yes" if f.CUDA_TARGETS else "no (nvcc was not found at build time)")')
