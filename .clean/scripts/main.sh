#!/usr/bin/env bash
# The main command: sets everything up on a fresh machine, then runs the pruned-model pipeline.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/setup_env.sh" examples
cd "$repo"
"$venv/bin/python" examples/pruned_lm.py "$@"
