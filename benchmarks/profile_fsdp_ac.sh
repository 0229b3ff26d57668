#!/usr/bin/env bash
# Issue 12 item 1: where FSDP2 + activation checkpointing loses time. Profiler traces of one model at one sequence
# length, one GPU vs FSDP2 on two, per AC setting, each summarised by benchmarks/analyze_trace.py (the numbers
# docs/experiments.md's hypotheses need) next to the run's metrics:
#
#   bash benchmarks/profile_fsdp_ac.sh OUT RUNS [CONFIG] [trainer overrides ...]
#
#   RUNS    comma list of <where>:<ac>[+<variant>...]: where = 1gpu | fsdp2 | fsdp1 | ddp (2 GPUs); ac = none | full | ratio0.5 |
#           selective_op; variants: prefetch2 (fsdp_prefetch 2), reshard_never, compile, bs2 (local batch 2),
#           units<k> (fsdp_blocks_per_unit k, e.g. units4).
#           e.g. 1gpu:none,1gpu:full,fsdp2:none,fsdp2:full
#   CONFIG  default train_configs/nsa_1b.toml (seq 8192, local batch 1)
#
# Per run: OUT/<run>/metrics.jsonl, summary.json, train.log and trace_summary.json (ranks' traces of steps 7-8
# summarised; the traces themselves stay in OUT/<run>/profile_traces, too big to bring back whole; a compact
# timeline_rank<i>.json.gz of each keeps kernels, FSDP ranges, autograd nodes and host syncs). ~1 min a run.
set -euo pipefail

OUT="${1:?usage: profile_fsdp_ac.sh OUT RUNS [CONFIG] [overrides ...]}"
RUNS="${2:?usage: profile_fsdp_ac.sh OUT RUNS [CONFIG] [overrides ...]}"
CFG="${3:-train_configs/nsa_1b.toml}"
shift $(( $# < 3 ? $# : 3 ))
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO_ROOT"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
mkdir -p "$OUT"

# 8 steps: log windows of 2; steps 3-6 untraced (tokens/s), the profiler warms up on 6 and records 7-8.
COMMON=(--config "$CFG" --training.steps 8 --metrics.log_freq 2 --metrics.val_freq 0 --checkpoint.enable false
        --metrics.nsa_diagnostics false --lr_scheduler.warmup_steps 2 --profiling.enable_profiling
        --profiling.profile_freq 8 --profiling.profile_active 2 --profiling.profile_warmup 1)

IFS=',' read -ra runs <<< "$RUNS"
for run in "${runs[@]}"; do
  where="${run%%:*}"; rest="${run#*:}"; IFS='+' read -ra parts <<< "$rest"; ac="${parts[0]}"
  flags=()
  case "$ac" in
    none|full|selective_op) flags+=(--activation_checkpoint.mode "$ac") ;;
    ratio*) flags+=(--activation_checkpoint.mode ratio --activation_checkpoint.ratio "${ac#ratio}") ;;
    *) echo "unknown AC setting $ac in $run" >&2; exit 2 ;;
  esac
  for v in "${parts[@]:1}"; do
    case "$v" in
      prefetch2) flags+=(--parallelism.fsdp_prefetch 2) ;;
      reshard_never) flags+=(--parallelism.fsdp_reshard_after_forward never) ;;
      compile) flags+=(--compile.enable) ;;
      bs2) flags+=(--training.local_batch_size 2) ;;
      units[0-9]*) flags+=(--parallelism.fsdp_blocks_per_unit "${v#units}") ;;
      *) echo "unknown variant $v in $run" >&2; exit 2 ;;
    esac
  done
  name="${run//[:+]/_}"; dump="$OUT/$name"; rm -rf "$dump"; mkdir -p "$dump"
  echo "[profile_fsdp_ac $(date -u +%H:%M:%S)] $name"
  if [[ "$where" == "1gpu" ]]; then
    CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" python3 -m nsa_titan.train "${COMMON[@]}" "${flags[@]}" "$@" --job.dump_folder "$dump" \
      > "$dump/train.log" 2>&1 || echo "  $name failed: $(tail -n 2 "$dump/train.log")"
  elif [[ "$where" == "fsdp2" || "$where" == "ddp" || "$where" == "fsdp1" ]]; then
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m nsa_titan.train "${COMMON[@]}" \
      --parallelism.data_parallel "$where" "${flags[@]}" "$@" --job.dump_folder "$dump" \
      > "$dump/train.log" 2>&1 || echo "  $name failed: $(tail -n 2 "$dump/train.log")"
  else
    echo "unknown place $where in $run (1gpu, fsdp2, fsdp1, ddp)" >&2; exit 2
  fi
  traces=("$dump"/profile_traces/iteration_8/rank*_trace.json)
  if [[ -e "${traces[0]}" ]]; then
    python3 benchmarks/analyze_trace.py "${traces[@]}" --top 8 --json "$dump/trace_summary.json" \
      --timeline "$dump/timeline_rank" | grep -v '^  [ 0-9]' || true
  fi
  grep -h '"type": "train"' "$dump/metrics.jsonl" 2>/dev/null | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    first = r["step"] - r["window_steps"] + 1
    print("  steps %d-%d: %s tok/s/GPU, peak reserved %s GiB"
          % (first, r["step"], format(r["tokens_per_s_per_gpu"], ",.0f"), r.get("peak_mem_reserved_gib")))' || true
done
