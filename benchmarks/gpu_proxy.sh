#!/usr/bin/env bash
# The small-scale proxy's design grid (experiments/grids/proxy-designs.yaml, 264 runs) on one GPU machine, within one
# device command: many runs at once on the one GPU (each run one process, one CPU thread), fp32 as on the CPU
# (precision 32-true; torch's default "highest" float32 matmul precision, so no TF32). Writes to $OUT:
#   gpu_proxy_env.json        GPU, driver, torch, CUDA, CPU count, the command, start/end, runs finished, runs/min
#   gpu_proxy_sweep.log       the sweep's own log
#   proxy-designs.tgz.partNN  the run directories without checkpoints, split into <= 15 MB pieces
# Reassemble here: cat proxy-designs.tgz.part* | tar xz -C runs/   then   lnstab report runs/proxy-designs ...
# Usage (repository root; the OpenWebText sample copied to .gpu/, wheels of missing packages in .whl/):
#   benchmarks/gpu_proxy.sh [GRID_SECONDS [PARALLEL [ONLY...]]]
# GPU_PROXY_ACCELERATOR=cpu runs the same pipeline on the CPU (a check of the script, e.g. with ONLY one run).
set -uo pipefail
cd "$(dirname "$0")/.."
GRID_SECONDS=${1:-470}
PARALLEL=${2:-16}
shift 2 2>/dev/null || shift $#
ONLY=("$@")
ACCEL=${GPU_PROXY_ACCELERATOR:-gpu}
OUT=${OUT:-/tmp/gpu_proxy_out}
ROOT=${GPU_PROXY_ROOT:-/tmp/gpu_proxy_runs}
mkdir -p "$OUT" "$ROOT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

if [[ -d .whl && "$ACCEL" == gpu ]]; then  # packages the GPU image lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_proxy: wheel install failed"; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# lnstab as pyproject lays it out (callbacks/ and datamodules/ are lnstab.callbacks and lnstab.datamodules), unbuilt.
PKG=${GPU_PROXY_PKG:-/tmp/gpu_proxy_pkg}
rm -rf "$PKG" && mkdir -p "$PKG" && cp -r lnstab "$PKG/lnstab" \
  && ln -s "$PWD/callbacks" "$PKG/lnstab/callbacks" && ln -s "$PWD/datamodules" "$PKG/lnstab/datamodules" \
  || { echo "gpu_proxy: could not lay out the package in $PKG"; exit 2; }
export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH}
DATA=${GPU_PROXY_DATA:-.gpu/owt-sample-900.jsonl.gz}
[[ -f "$DATA" ]] || { echo "gpu_proxy: no data at $DATA"; exit 2; }
DATA=$(realpath "$DATA")
# Run from the laid-out package: `python -m` puts the working directory first on sys.path, and the checkout's own
# lnstab/ (no callbacks/ inside) would shadow it.
ln -s "$PWD/experiments" "$PKG/experiments" && cd "$PKG" || exit 2

# A two-step run first: a broken environment costs seconds, not the grid's time.
rm -rf /tmp/gpu_proxy_smoke
if ! timeout 180 python3 -m lnstab.cli fit --config experiments/proxy.yaml --trainer.accelerator "$ACCEL" \
    --data.init_args.path "$DATA" --evaluation.bertscore_model roberta-large --trainer.max_steps 2 \
    --trainer.val_check_interval 2 --checkpoint.every_n_train_steps 2 --run_dir /tmp/gpu_proxy_smoke \
    >"$OUT/gpu_proxy_smoke.log" 2>&1; then
  tail -40 "$OUT/gpu_proxy_smoke.log"; echo "gpu_proxy: the two-step smoke run failed"; exit 3
fi
echo "gpu_proxy: smoke run ok: $(grep -m1 -o 'GPU available: [A-Za-z]*' "$OUT/gpu_proxy_smoke.log")"

finished_before=$(grep -ls '"status": "\(completed\|diverged\)"' "$ROOT"/proxy-designs/*/summary.json 2>/dev/null | wc -l)
start=$(date +%s)
only_args=()
(( ${#ONLY[@]} )) && only_args=(--only "${ONLY[@]}")
timeout -s TERM -k 60 "$GRID_SECONDS" python3 -m lnstab.cli sweep experiments/grids/proxy-designs.yaml \
  --root "$ROOT" --parallel "$PARALLEL" "${only_args[@]}" \
  --set trainer.accelerator="$ACCEL" --set data.init_args.path="$DATA" \
  --set evaluation.bertscore_model=roberta-large \
  >"$OUT/gpu_proxy_sweep.log" 2>&1
rc=$?
end=$(date +%s)
tail -5 "$OUT/gpu_proxy_sweep.log"

python3 - "$ROOT/proxy-designs" "$OUT/gpu_proxy_env.json" "$start" "$end" "$rc" "$PARALLEL" "$ACCEL" "$finished_before" <<'EOF'
import json, os, platform, subprocess, sys
root, out, start, end, rc, parallel, accel, before = sys.argv[1:]
import torch
done = diverged = 0
runs = sorted(r for r in os.listdir(root) if not r.startswith(".")) if os.path.isdir(root) else []
for run in runs:
    try:
        with open(os.path.join(root, run, "summary.json")) as f:
            status = json.load(f).get("status")
    except (OSError, ValueError):
        continue
    done += status in ("completed", "diverged")
    diverged += status == "diverged"
def smi(q):
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001 - a record, not a check
        return f"unavailable: {e}"
minutes = (int(end) - int(start)) / 60
json.dump({
    "accelerator": accel, "gpu": smi("name,memory.total,driver_version"), "torch": torch.__version__,
    "cuda": torch.version.cuda, "python": platform.python_version(), "cpus": os.cpu_count(),
    "parallel": int(parallel), "sweep_exit": int(rc), "wall_s": int(end) - int(start),
    "run_directories": len(runs), "runs_finished": done, "runs_diverged": diverged,
    "runs_finished_before": int(before),  # a rerun resumes: only this call's runs count in its rate
    "runs_per_minute": round((done - int(before)) / minutes, 2) if minutes > 0 else None,
}, open(out, "w"), indent=1)
print(open(out).read())
EOF

# The run directories without checkpoints, in pieces small enough to come back.
tar czf - --exclude='*.ckpt' --exclude='.lnstab.lock' -C "$ROOT" proxy-designs | split -b 15m -d - "$OUT/proxy-designs.tgz.part"
ls -la "$OUT"
