#!/usr/bin/env bash
# Train an NSA model.
#   ./run_train.sh [--section.key value ...]          # debug model, on GPU(s) if present, else CPU
#   NGPU=8 CONFIG_FILE=train_configs/nsa_1b.toml ./run_train.sh --training.steps 100
# Environment:
#   NGPU         processes to start (default: the GPUs nvidia-smi lists, else 0 = one CPU process);
#                NGPU > 1 uses torchrun (NCCL on GPUs, gloo on a CPU-only machine).
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml of this repository).
#   PYTHON       interpreter (default: python3).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
PYTHON="${PYTHON:-python3}"
PYTHON="$("$PYTHON" -c 'import sys; print(sys.executable)')"  # absolute, so `cd /` below keeps it
CONFIG_FILE="${CONFIG_FILE:-$REPO_ROOT/train_configs/debug_model.toml}"

# NVLink multicast (NVLS) is unavailable or unreliable on the shared multi-GPU hosts we train on, and
# NCCL / symmetric memory would otherwise try it at init; keep it off unless the caller says otherwise.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"

detect_ngpu() {
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo 0
    return
  fi
  local n
  n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
  # nvidia-smi lists every GPU of the host; a restricted CUDA_VISIBLE_DEVICES caps what we may use.
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    local visible=()
    IFS=',' read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
    if (( ${#visible[@]} < n )); then n=${#visible[@]}; fi
  fi
  echo "${n:-0}"
}
NGPU="${NGPU:-$(detect_ngpu)}"

# First use on a fresh machine: torch, then this package. Pin torch: an unpinned install would pull a
# multi-GB CUDA build where a CPU wheel is what this machine has on disk.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "run_train.sh: torch not found; installing torch==2.13.0" >&2
  "$PYTHON" -m pip install "torch==2.13.0"
fi
# The rest of pyproject.toml's runtime dependencies (the package itself is installed with --no-deps below).
missing=()
"$PYTHON" -c "import numpy" >/dev/null 2>&1 || missing+=("numpy")
"$PYTHON" -c "import sys; sys.exit(sys.version_info < (3, 11))" || "$PYTHON" -c "import tomli" >/dev/null 2>&1 \
  || missing+=("tomli>=1.1")
if (( ${#missing[@]} )); then
  echo "run_train.sh: installing ${missing[*]}" >&2
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

if (( NGPU <= 1 )); then
  exec "$PYTHON" -m nsa_titan.train --config "$CONFIG_FILE" "$@"
else
  # `python -m torch.distributed.run` is torchrun, run by the chosen $PYTHON.
  exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
    -m nsa_titan.train --config "$CONFIG_FILE" "$@"
fi
