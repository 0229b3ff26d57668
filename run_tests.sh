#!/usr/bin/env bash
# Install what the tests need on a fresh machine, then run them: ./run_tests.sh [pytest args ...]
# Environment: PYTHON (default python3).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
PYTHON="${PYTHON:-python3}"
PYTHON="$("$PYTHON" -c 'import sys; print(sys.executable)')"  # absolute, so `cd /` below keeps it
cd "$REPO_ROOT"

# Pinned: an unpinned torch would pull a multi-GB CUDA build; 2.13.0 is the CPU wheel this machine has.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q "torch==2.13.0"
fi
# triton: CPU-interpreter tests of the kernels; safetensors: the model-export tests; tensorboard stays
# optional (its tests skip without it).
missing=()
for mod in pytest triton numpy safetensors; do
  "$PYTHON" -c "import $mod" >/dev/null 2>&1 || missing+=("$mod")
done
if (( ${#missing[@]} )); then
  "$PYTHON" -m pip install -q "${missing[@]}"
fi
# Where `import nsa_titan` resolves from outside the repository ("" if nowhere). Checked from / so
# that subprocesses in any directory (torchrun workers, tests' subprocesses) can import it, and so
# that a stale install of another clone does not shadow this one.
nsa_root() {
  (cd / && "$PYTHON" -c 'import os, nsa_titan; print(os.path.dirname(os.path.dirname(os.path.realpath(nsa_titan.__file__))))') \
    2>/dev/null || true
}
if [[ "$(nsa_root)" != "$REPO_ROOT" ]]; then
  # Machines without a network may fail to install; the source tree on PYTHONPATH works just as well.
  "$PYTHON" -m pip install -q -e "$REPO_ROOT" --no-deps --no-build-isolation >/dev/null 2>&1 || true
  if [[ "$(nsa_root)" != "$REPO_ROOT" ]]; then
    export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

set +e
"$PYTHON" -m pytest -q tests "$@"
status=$?
set -e
exit "$status"
