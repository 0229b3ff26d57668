#!/usr/bin/env bash
# The GA/AC tables of the H100 study (docs/experiments.md, "GA/AC planner"), one planner run per table, in
# priority order, sharing one time limit so that a call stays under 10 minutes; call again to continue (probes
# are cached under OUT/ac_plan_<tag>/):
#
#   bash benchmarks/run_study.sh OUT TIME_LIMIT_S TAG_SUFFIX TABLES [planner flags ...] [trainer overrides ...]
#
#   TABLES        comma list of flavor:seq, e.g. 1b:8192,qwen7b:8192,1b:32768,qwen7b:4096 (flavors 1b, qwen7b,
#                 m7c, debug); tag = <flavor>_seq<seq><TAG_SUFFIX>, config = the flavor's train_configs file
#   planner flags e.g. --memory-cap-gib 79.1 (an 80 GB H100 on a bigger GPU), --check-estimate (beside real
#                 multi-GPU rows), --collectives OUT/parallel_comm_h200x2.json (measured bandwidth)
#
# Study settings: effective batch 64, GPU counts 1,2,4,8,16 (those beyond the machine's GPUs run as fake process
# groups, with estimated communication), local batches 1,2,4,8, AC ratios 0..1 in steps of 0.1, eager.
set -euo pipefail

OUT="${1:?usage: run_study.sh OUT TIME_LIMIT_S TAG_SUFFIX TABLES [flags ...]}"
LIMIT="${2:?usage: run_study.sh OUT TIME_LIMIT_S TAG_SUFFIX TABLES [flags ...]}"
SUFFIX="${3-}"
TABLES="${4:?usage: run_study.sh OUT TIME_LIMIT_S TAG_SUFFIX TABLES [flags ...]}"
shift 4
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO_ROOT"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # NVLink multicast off (README)
mkdir -p "$OUT"

config_of() {
  case "$1" in
    1b) echo train_configs/nsa_1b.toml ;;
    qwen7b) echo train_configs/nsa_qwen7b.toml ;;
    m7c) echo train_configs/m7c_125m.toml ;;
    debug) echo train_configs/debug_model.toml ;;
    *) echo "run_study.sh: unknown flavor $1 (1b, qwen7b, m7c, debug)" >&2; return 2 ;;
  esac
}

start=$SECONDS
IFS=',' read -ra specs <<< "$TABLES"
for spec in "${specs[@]}"; do
  flavor="${spec%%:*}"; seq="${spec##*:}"
  cfg="$(config_of "$flavor")"
  left=$(( LIMIT - (SECONDS - start) ))
  if (( left <= 0 )); then echo "[run_study] time limit reached before $spec: call again to continue"; break; fi
  tag="${flavor}_seq${seq}${SUFFIX}"
  echo "[run_study $(date -u +%H:%M:%S)] $tag ($cfg), ${left}s left"
  # max_seq_len follows the sequence (1b's flavor covers 8k); lr warm-up must fit the probes' few steps.
  python3 -m nsa_titan.experiments.ac_planner --config "$cfg" --gpus 1,2,4,8,16 --effective-batch 64 \
    --local-batches 1,2,4,8 --ratios 0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1 --probe-timeout-s 240 \
    --time-limit-s "$left" --out "$OUT" --tag "$tag" "$@" \
    -- --training.seq_len "$seq" --model.max_seq_len "$seq" --lr_scheduler.warmup_steps 2
done
