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
# Optional packages whose tests otherwise skip: torchdata (the loader's workers), datasets + pyarrow (streamed
# parquet), tokenizers and tiktoken (tokenizer files), transformers (exports that AutoModel loads). Best
# effort: a machine without a network still runs the rest, and those tests say they were skipped.
optional=()
for spec in torchdata:torchdata datasets:datasets pyarrow:pyarrow tokenizers:tokenizers tiktoken:tiktoken \
            transformers:transformers; do
  "$PYTHON" -c "import ${spec%%:*}" >/dev/null 2>&1 || optional+=("${spec#*:}")
done
if (( ${#optional[@]} )); then
  "$PYTHON" -m pip install -q "${optional[@]}" >/dev/null 2>&1 \
    || echo "run_tests.sh: could not install ${optional[*]}; their tests will be skipped" >&2
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
