#!/usr/bin/env bash
# One GPU check of lnstab's performance, under 5 minutes on one H200 (figures to $OUT/gpu_check_*.json if OUT is set):
#   1. 124M (gpt2_pre_dt1.yaml) in bf16-mixed at 32 x 1024 per GPU: tokens/s and MFU through Lightning, eager and
#      compiled, and whether any training step that does not log synchronises with the host;
#   2. the training step against Hugging Face GPT-2 (sdpa, fused AdamW) in bf16 and the reference in fp32;
#   3. the paper's instruments (base.yaml cadence) against none over whole compiled runs (goal: <= 2 %);
#   4. a few steps of the 1.5B FSDP config (gpt2-xl_pre_dt1.yaml) on this one GPU, peak memory against the estimate
#      (if 1.5B does not fit, rerun that phase with --preset gpt2-large).
# Run from the repository root in an environment with the CUDA build of torch and `pip install -e .`.
#   benchmarks/gpu_check.sh             # on the GPU
#   benchmarks/gpu_check.sh --dry-run   # tiny shapes on the CPU: checks that every phase runs, measures nothing
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=""
[[ "${1:-}" == "--dry-run" ]] && DRY="--dry-run"
OUTARGS=()
[[ -n "${OUT:-}" ]] && OUTARGS=(--out "$OUT")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
start=$SECONDS

python -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
[[ -z "$DRY" ]] && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true

# Each phase is capped so that the whole stays under 290 s; a phase that fails or times out is reported, the rest run.
phase() {  # phase NAME CAP_SECONDS COMMAND...
  local name=$1 cap=$2 left=$((290 - (SECONDS - start))); shift 2
  (( left < cap )) && cap=$left
  if (( cap < 5 )); then echo "gpu_check: $name skipped (time budget spent)"; return; fi
  timeout "$cap" "$@" || echo "gpu_check: $name FAILED or timed out after ${cap} s (exit $?)"
}
phase step 120 python benchmarks/gpu_check.py step $DRY "${OUTARGS[@]}"
if [[ -z "$DRY" ]]; then
  phase bench_model 40 python benchmarks/bench_model.py --device cuda --precision bf16-mixed --preset gpt2 \
    --seq 1024 --batch 16 --steps 10 --warmup 3 --out "${OUT:-}"
else
  phase bench_model 200 python benchmarks/bench_model.py --preset tiny --seq 64 --batch 2 --steps 2 --warmup 1
fi
phase instruments 70 python benchmarks/gpu_check.py instruments $DRY "${OUTARGS[@]}"
phase fsdp 60 python benchmarks/gpu_check.py fsdp $DRY "${OUTARGS[@]}"
echo "gpu_check: done in $((SECONDS - start)) s"
