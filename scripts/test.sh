#!/usr/bin/env bash
# The test command: sets everything up on a fresh machine, then runs the whole test suite.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/setup_env.sh" test
cd "$repo"
echo "==> running the tests"
# One worker per core (pytest-xdist); worksteal rebalances the long compile tests at the end.
"$venv/bin/pytest" -n auto --dist worksteal tests "$@"
