#!/usr/bin/env bash
# ONE prepared check for a CUDA machine with one GPU and about 10 minutes: the small presets
# (~20M parameters, 256 px) in bf16, for Flux and Qwen-Image,
#   1. vanilla and JAGG (W 4, jagg_frac 0.6), 3 training steps each, in a single process;
#   2. the same under `torchrun --nproc_per_node=1` (the launcher's path; with one rank no process
#      group is created, so this checks the launch, not NCCL collectives);
#   3. JAGG with `--jagg_frac auto` and the fidelity monitor at every step (its cosines and its
#      own time, counted apart);
#   4. the update-phase micro-benchmark `jagg_patch.tools.bench_update` at upstream's geometry (S 16 /
#      20, fraction 0.6);
# then prints ONE table: median step / update / monitor seconds, cuda_peak_mb, backwards per step and
# the monitor's cosines of every run, and bench_update's update / whole-step gains. Outputs under $OUT (runs/gpu_check).
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine
#   MODELS=flux STEPS=2 bash benchmarks/gpu_check.sh
#
# Without CUDA it exits at once (status 3) with a message, running nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False): run this on a machine with a GPU;" \
       "nothing was run. On CPU use benchmarks/speed.sh with PRESET=small." >&2
  exit 3
fi
OUT="${OUT:-runs/gpu_check}"
MODELS="${MODELS:-flux qwenimage}"
STEPS="${STEPS:-3}"
CACHE_DIR="${CACHE_DIR:-./cache_dir}"
JAGG_FLAGS=(--jagg_window 4 --jagg_frac 0.6)
TORCHRUN=("$PY" -m torch.distributed.run)   # torchrun itself, from the same Python as the other runs
mkdir -p "$OUT"
T0=$SECONDS

run() {  # name, then the command; its log goes to $OUT/<name>.log
  local name="$1"; shift
  echo "== $name" >&2
  "$@" > "$OUT/$name.log" 2>&1 || { echo "error: $name failed; last lines of $OUT/$name.log:" >&2; tail -20 "$OUT/$name.log" >&2; exit 1; }
}

for model in $MODELS; do
  trainer="dancegrpo.train_grpo_$model"
  S=$([[ "$model" == flux ]] && echo 16 || echo 20)
  common=(--preset small --cache_dir "$CACHE_DIR" --mixed_precision bf16 --max_train_steps "$STEPS"
          --overwrite_output_dir --checkpointing_steps 100000)
  run "$model-vanilla" "$PY" -m "$trainer" "${common[@]}" --output_dir "$OUT/$model-vanilla"
  run "$model-jagg" "$PY" -m jagg_patch "$trainer" "${JAGG_FLAGS[@]}" "${common[@]}" --output_dir "$OUT/$model-jagg"
  run "$model-jagg-auto" "$PY" -m jagg_patch "$trainer" --jagg_window 4 --jagg_frac auto --jagg_monitor_every 1 \
    "${common[@]}" --output_dir "$OUT/$model-jagg-auto"
  run "$model-torchrun-vanilla" "${TORCHRUN[@]}" --standalone --nproc_per_node=1 -m "$trainer" "${common[@]}" \
    --output_dir "$OUT/$model-torchrun-vanilla"
  run "$model-torchrun-jagg" "${TORCHRUN[@]}" --standalone --nproc_per_node=1 -m jagg_patch "$trainer" "${JAGG_FLAGS[@]}" \
    "${common[@]}" --output_dir "$OUT/$model-torchrun-jagg"
  run "$model-bench_update" "$PY" -m jagg_patch.tools.bench_update "$trainer" --preset small --cache_dir "$CACHE_DIR" \
    --mixed_precision bf16 --output_dir "$OUT/$model-bench" --sampling_steps "$S" --timestep_fraction 0.6 \
    "${JAGG_FLAGS[@]}" --bench_reps 3 --bench_modes vanilla,jagg,jagg_split,jagg_batched,jagg_split_reuse,jagg_batched_reuse \
    --bench_json "$OUT/$model-bench_update.json" --bench_md "$OUT/$model-bench_update.md"
done

OUT="$OUT" MODELS="$MODELS" ELAPSED=$((SECONDS - T0)) "$PY" - <<'PY'
import json, os, statistics
out, models = os.environ["OUT"], os.environ["MODELS"].split()
import torch
print(f"# GPU check: {torch.cuda.get_device_name(0)} | torch {torch.__version__} | {os.environ['ELAPSED']} s\n")
print("| run | step s | update s | monitor s | cuda_peak_mb | backwards / step | jagg_cos per position (last step) |")
print("|---|---|---|---|---|---|---|")
for model in models:
    for run in ("vanilla", "jagg", "jagg-auto", "torchrun-vanilla", "torchrun-jagg"):
        with open(os.path.join(out, f"{model}-{run}", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        timed = rows[1:] or rows
        med = lambda k: statistics.median(r[k] for r in timed if k in r) if any(k in r for r in timed) else float("nan")
        cos = " ".join(f"{rows[-1][k]:.3f}" for k in sorted(rows[-1]) if k.startswith("jagg_cos/"))
        print(f"| {model} {run} | {med('step_time_s'):.3f} | {med('update_time_s'):.3f} | "
              f"{med('monitor_time_s'):.3f} | {med('cuda_peak_mb'):.0f} | {med('transformer_backwards'):g} | {cos} |")
print("\n| model | bench_update mode | update gain | predicted | whole-step gain | activation peak MB vanilla -> mode |")
print("|---|---|---|---|---|---|")
for model in models:
    with open(os.path.join(out, f"{model}-bench_update.json")) as f:
        b = json.load(f)
    for mode, j in b["modes"].items():
        if mode != "vanilla":
            print(f"| {model} | {mode}{' (default)' if mode == b['headline'] else ''} | {100 * j['update_gain']:+.1f}% | "
                  f"{100 * j['predicted_update_gain']:+.1f}% | {100 * j['step_gain']:+.1f}% | "
                  f"{b['modes']['vanilla']['activation_peak_mb']:.1f} -> {j['activation_peak_mb']:.1f} |")
PY
