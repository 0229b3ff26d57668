#!/usr/bin/env bash
# The three experiments (docs/experiments.md) for m7c and 1b at seq 8192, in short resumable stages:
#
#   bash benchmarks/run_experiments.sh OUT_DIR STAGE [TIME_LIMIT_S] [--cpu-smoke]
#
#   STAGE  plan     GA/AC planner, effective batch 64, GPU counts 1,2,8 (m7c on GPU 0 and 1b on GPU 1 at once;
#                   each planner sees one GPU, so its 2- and 8-GPU rows come from fake process groups:
#                   per-rank memory as on N GPUs, compute-only time)
#          compile  compile on/off, NSA and dense SDPA, 1 GPU (m7c on GPU 0 and 1b on GPU 1 at once); 1b takes
#                   the batch and AC ratio of the 1-GPU plan when OUT_DIR/ac_plan_1b_seq8192.json exists
#          dp       FSDP2 vs FSDP1 vs DDP on 1 and 2 GPUs, AC none and full (m7c, then 1b; needs 2 GPUs)
#          all      plan, compile, dp (for a machine without a per-call limit)
#   TIME_LIMIT_S   no new run or probe starts after this (default 400); runs in flight finish (each capped at
#                  150-240 s), so a stage stays under 10 minutes. Call the same stage again to continue:
#                  finished runs and probes are reused, reports are rewritten with everything so far.
#   --cpu-smoke    the same stages on the CPU with a tiny model (checks this script, not speed)
#
# Suggested order in three calls: plan, compile, dp. Outputs: OUT_DIR/{ac_plan,compile,dp_compare}_<flavor>_seq8192
# .{md,json,png} plus per-run folders (metrics.jsonl, summary.json, logs) next to them.
set -euo pipefail

OUT="${1:?usage: run_experiments.sh OUT_DIR plan|compile|dp|all [TIME_LIMIT_S] [--cpu-smoke]}"
STAGE="${2:?usage: run_experiments.sh OUT_DIR plan|compile|dp|all [TIME_LIMIT_S] [--cpu-smoke]}"
LIMIT="${3:-400}"
SMOKE="${4:-}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO_ROOT"
PY="$(command -v python3)"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # NVLink multicast off (README)
mkdir -p "$OUT"

NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then NGPU="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi

# Per flavor: config file, trainer overrides, planner local batches, tag. lr warm-up must fit the short runs.
M7C_CFG=train_configs/m7c_125m.toml
M7C_ARGS=(--training.seq_len 8192 --training.local_batch_size 2 --lr_scheduler.warmup_steps 2)
M7C_BATCHES=2,8,32
ONEB_CFG=train_configs/nsa_1b.toml
ONEB_ARGS=(--training.seq_len 8192 --training.local_batch_size 1 --lr_scheduler.warmup_steps 2)
ONEB_BATCHES=1,4,16
TAG=seq8192
STEPS=(--steps 9 --warmup 3)   # log windows of 3 steps; the first 3 (compilation, autotuning) are not timed
GPUS_PLAN=1,2,8
CPU=()
PLAN_EXTRA=(--ratios 0,0.25,0.5,0.75,1 --probe-timeout-s 150)
if [[ "$SMOKE" == "--cpu-smoke" ]]; then
  TINY=(--model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 2 --model.head_dim 16
        --model.ffn_hidden_dim 96 --model.cmp_block 8 --model.cmp_stride 4 --model.slc_block 16 --model.slc_top_n 3
        --model.window 24 --model.vocab_size 260 --training.seq_len 64 --training.local_batch_size 2
        --lr_scheduler.warmup_steps 1 --training.device cpu)
  M7C_CFG=train_configs/debug_model.toml; M7C_ARGS=("${TINY[@]}"); M7C_BATCHES=1,2
  ONEB_CFG=train_configs/debug_model.toml; ONEB_ARGS=("${TINY[@]}"); ONEB_BATCHES=1,2
  TAG=cpu_smoke; STEPS=(--steps 4 --warmup 2); GPUS_PLAN=1,2; CPU=(--cpu); NGPU=0
  PLAN_EXTRA=(--ratios 0,1 --memory-budget-gib 1000 --warmup 1 --steps 1)
fi

log() { echo "[run_experiments $(date -u +%H:%M:%S)] $*"; }

# Two single-GPU jobs: one per GPU at once when there are two, else one after the other.
# Usage: both FUNCTION_FOR_M7C FUNCTION_FOR_1B (each gets the flavor's config, tag and args).
both() {
  local f1="$1" f2="$2" rc=0
  if (( NGPU >= 2 )); then
    CUDA_VISIBLE_DEVICES=0 "$f1" "$M7C_CFG" "m7c_$TAG" "$M7C_BATCHES" "${M7C_ARGS[@]}" > "$OUT/$f1.m7c.log" 2>&1 &
    local p1=$!
    CUDA_VISIBLE_DEVICES=1 "$f2" "$ONEB_CFG" "1b_$TAG" "$ONEB_BATCHES" "${ONEB_ARGS[@]}" > "$OUT/$f2.1b.log" 2>&1 &
    local p2=$!
    wait "$p1" || rc=$?
    wait "$p2" || rc=$?
    tail -n 40 "$OUT/$f1.m7c.log" "$OUT/$f2.1b.log"
  else
    "$f1" "$M7C_CFG" "m7c_$TAG" "$M7C_BATCHES" "${M7C_ARGS[@]}" || rc=$?
    "$f2" "$ONEB_CFG" "1b_$TAG" "$ONEB_BATCHES" "${ONEB_ARGS[@]}" || rc=$?
  fi
  return "$rc"
}

plan_one() {  # CONFIG TAG BATCHES ARGS...
  local cfg="$1" tag="$2" batches="$3"; shift 3
  "$PY" -m nsa_titan.experiments.ac_planner --config "$cfg" --gpus "$GPUS_PLAN" --effective-batch 64 \
    --local-batches "$batches" "${PLAN_EXTRA[@]}" --time-limit-s "$LIMIT" --out "$OUT" --tag "$tag" -- "$@"
}

compile_one() {  # CONFIG TAG BATCHES ARGS...
  local cfg="$1" tag="$2"; shift 3
  local plan=()
  # The 1-GPU recommendation of this flavor's plan, when there is one (the "best AC" of the MFU target).
  if [[ -f "$OUT/ac_plan_$tag.json" ]] && "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if '1' in d['recommendations'] else 1)" "$OUT/ac_plan_$tag.json"; then
    plan=(--from-plan "$OUT/ac_plan_$tag.json")
  fi
  "$PY" -m nsa_titan.experiments.compile_report --config "$cfg" --attn nsa,dense "${plan[@]}" "${STEPS[@]}" \
    "${CPU[@]}" --run-timeout-s 240 --time-limit-s "$LIMIT" --out "$OUT" --tag "$tag" -- "$@"
}

dp_one() {  # CONFIG TAG BATCHES ARGS... (all GPUs)
  local cfg="$1" tag="$2"; shift 3
  local extra=()
  if [[ -n "${CPU[*]}" ]]; then extra=(--ac none --data-parallel fsdp2); fi  # the smoke test keeps it short
  "$PY" -m nsa_titan.experiments.dp_compare --config "$cfg" --gpus 1,2 --ac none,full "${extra[@]}" "${STEPS[@]}" \
    "${CPU[@]}" --run-timeout-s 180 --time-limit-s "$LIMIT" --out "$OUT" --tag "$tag" -- "$@"
}

run_stage() {
  case "$1" in
    plan) log "plan (limit ${LIMIT}s)"; both plan_one plan_one ;;
    compile) log "compile (limit ${LIMIT}s)"; both compile_one compile_one ;;
    dp)
      if [[ -z "${CPU[*]}" ]] && (( NGPU < 2 )); then log "dp needs 2 GPUs, found $NGPU"; return 1; fi
      log "dp (limit ${LIMIT}s, shared by both flavors)"
      local t0=$SECONDS
      dp_one "$M7C_CFG" "m7c_$TAG" "" "${M7C_ARGS[@]}"
      LIMIT=$(( LIMIT - (SECONDS - t0) > 0 ? LIMIT - (SECONDS - t0) : 0 )) dp_one "$ONEB_CFG" "1b_$TAG" "" "${ONEB_ARGS[@]}" ;;
    all) run_stage plan; run_stage compile; run_stage dp ;;
    *) echo "unknown stage $1: plan | compile | dp | all" >&2; return 2 ;;
  esac
}

run_stage "$STAGE"
log "done: $STAGE; reports:"
ls -1 "$OUT"/*.md 2>/dev/null || true
