#!/usr/bin/env bash
# The paper's gradient-fidelity analysis ("cosine 0.74-0.85 in groups 0-2"): per group index, in
# denoising order, cosine(JAGG group gradient, exact) and cosine(endpoints ablation, exact),
# averaged over ROLLOUTS rollouts, for each window in WINDOWS.
#
#   PRESET=small bash benchmarks/fidelity.sh           # CPU, embedded ~20M-parameter models
#   bash benchmarks/fidelity.sh                        # real weights (one process; see REPRODUCE.md)
#   PRESET=small MODELS=flux WINDOWS="3 4" ROLLOUTS=3 SAMPLES=4 WARMUP_STEPS=0 bash benchmarks/fidelity.sh
#   JAGG_GROUPING=window PRESET=small bash benchmarks/fidelity.sh   # rows = trajectory windows (authors)
#
# Runs `python -m jagg_patch.tools.fidelity` through the train scripts (JAGG_LAUNCHER), so the model, data
# and geometry are the training run's. Outputs: $OUT/fidelity/<model>/w<W>/fidelity.{json,csv,md},
# and $OUT/fidelity/fidelity.md with all tables. Settings: benchmarks/common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
WINDOWS="${WINDOWS:-3 4}"
ROLLOUTS="${ROLLOUTS:-3}"
SAMPLES="${SAMPLES:-4}"
WARMUP_STEPS="${WARMUP_STEPS:-0}"
DEST="$OUT/fidelity"
mkdir -p "$DEST"
REPORT="$DEST/fidelity.md"
{
  echo "# Gradient fidelity"
  echo
  echo "$(machine_line)"
  echo "preset: ${PRESET:-none (real weights)} | S flux $S_FLUX, qwenimage $S_QWEN | timestep_fraction $TIMESTEP_FRACTION | windows $WINDOWS | $ROLLOUTS rollouts x $SAMPLES samples | $WARMUP_STEPS vanilla warm-up steps${SIZE_ARGS:+ | extra flags: $SIZE_ARGS}"
} > "$REPORT"
for model in $MODELS; do
  for w in $WINDOWS; do
    dir="$DEST/$model/w$w"
    rm -rf "$dir"; mkdir -p "$dir"
    echo "== $model / window $w" >&2
    JAGG=1 JAGG_LAUNCHER=jagg_patch.tools.fidelity JAGG_WINDOW="$w" JAGG_FRAC=1.0 NPROC=1 OUTPUT_DIR="$dir/run" \
      bash "$(train_script "$model")" --sampling_steps "$(sampling_steps "$model")" \
      --timestep_fraction "$TIMESTEP_FRACTION" "${SIZE[@]}" --fid_rollouts "$ROLLOUTS" --diag_samples "$SAMPLES" \
      --diag_warmup_steps "$WARMUP_STEPS" --fid_out "$dir" > "$dir.log" 2>&1 \
      || { echo "error: fidelity run failed; see $dir.log" >&2; tail -20 "$dir.log" >&2; exit 1; }
    { echo; cat "$dir/fidelity.md"; } >> "$REPORT"
  done
done
echo "wrote $REPORT" >&2
cat "$REPORT"
