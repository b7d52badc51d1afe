#!/usr/bin/env bash
# The paper's speed table: seconds per training step and update-phase seconds for vanilla
# DanceGRPO, JAGG and the endpoints ablation, Flux (S 16) and Qwen-Image (S 20), timestep_fraction
# 0.6, JAGG_WINDOW / JAGG_FRAC as configured.
#
#   bash benchmarks/speed.sh                        # GPUs, real weights (train scripts' recipes)
#   PRESET=small bash benchmarks/speed.sh           # CPU, embedded ~20M-parameter models
#   PRESET=small MODELS=flux STEPS=3 BENCH_REPS=3 bash benchmarks/speed.sh
#
# Two measurements per model, both written under $OUT/speed/<model>/:
# 1. training runs (STEPS steps each, same seed) through train_flux.sh / train_qwenimage.sh, then
#    `python -m jagg_patch.tools.compare` -> compare/comparison.{json,csv,md}, rewards.csv, PNG plots;
# 2. with MICRO=1 (default), the update-phase micro-benchmark `jagg_patch.tools.bench_update` (vanilla,
#    JAGG, exact, endpoints interleaved in ONE process on one rollout, BENCH_REPS repetitions,
#    measured vs predicted speedup) -> bench_update.{json,md}.
# $OUT/speed/speed.md collects the tables. Settings: benchmarks/common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
STEPS="${STEPS:-$([[ -n "$PRESET" ]] && echo 3 || echo 5)}"
MICRO="${MICRO:-1}"
BENCH_REPS="${BENCH_REPS:-3}"
BENCH_UNIT_REPS="${BENCH_UNIT_REPS:-3}"
DEST="$OUT/speed"
mkdir -p "$DEST"
REPORT="$DEST/speed.md"
{
  echo "# Speed benchmark"
  echo
  echo "$(machine_line)"
  echo "preset: ${PRESET:-none (real weights)} | window $JAGG_WINDOW | jagg_frac $JAGG_FRAC | S flux $S_FLUX, qwenimage $S_QWEN | timestep_fraction $TIMESTEP_FRACTION | $STEPS training steps per run${SIZE_ARGS:+ | extra flags: $SIZE_ARGS}"
} > "$REPORT"

for model in $MODELS; do
  dirs=(); labels=()
  for variant in $VARIANTS; do
    run_variant "$model" "$variant" "$DEST/$model/$variant" --max_train_steps "$STEPS"
    dirs+=("$DEST/$model/$variant"); labels+=("$variant")
  done
  {
    echo; echo "## $model: training runs ($STEPS steps; medians after the first step)"; echo
  } >> "$REPORT"
  labels_csv="$(IFS=,; echo "${labels[*]}")"
  "$PY" -m jagg_patch.tools.compare "${dirs[@]}" --labels "$labels_csv" --out "$DEST/$model/compare" --ma_window 5 \
    > /dev/null
  cat "$DEST/$model/compare/comparison.md" >> "$REPORT"
  if [[ "$MICRO" == "1" ]]; then
    echo "== $model / update-phase micro-benchmark" >&2
    # This script's targets for the default (rollout reuse on_policy, GA covering the rollout), and the paper's
    # whole-step gain: the tool holds none.
    case "$model" in
      flux) targets=(--bench_target_step 0.25 --bench_target_update 0.40 --bench_paper_step_gain 0.183) ;;
      qwenimage) targets=(--bench_target_step 0.172 --bench_paper_step_gain 0.172) ;;
      *) targets=() ;;
    esac
    JAGG=1 JAGG_LAUNCHER=jagg_patch.tools.bench_update NPROC="${BENCH_NPROC:-${NPROC:-}}" \
      OUTPUT_DIR="$DEST/$model/bench_run" bash "$(train_script "$model")" \
      --sampling_steps "$(sampling_steps "$model")" --timestep_fraction "$TIMESTEP_FRACTION" "${SIZE[@]}" \
      --bench_reps "$BENCH_REPS" --bench_unit_reps "$BENCH_UNIT_REPS" "${targets[@]}" \
      --bench_json "$DEST/$model/bench_update.json" --bench_md "$DEST/$model/bench_update.md" \
      > "$DEST/$model/bench_update.log" 2>&1 \
      || { echo "error: micro-benchmark failed; see $DEST/$model/bench_update.log" >&2; tail -20 "$DEST/$model/bench_update.log" >&2; exit 1; }
    { echo; sed 's/^## /## /' "$DEST/$model/bench_update.md"; } >> "$REPORT"
  fi
done
echo "wrote $REPORT" >&2
cat "$REPORT"
