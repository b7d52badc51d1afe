#!/usr/bin/env bash
# The digits world's tables, end to end on CPU (the trained models of --preset digits, or of
# --preset digits_large with PRESET=digits_large):
#   1. quality: every VARIANT x SEED trains STEPS GRPO steps on the `digit` reward, writing a
#      checkpoint every EVAL_EVERY steps; dancegrpo.evaluate scores the model before training
#      (base@0) and every checkpoint on the held-out classifier (`digit_heldout`, 40 prompts x
#      EVAL_IMAGES fixed-noise ODE samples); jagg_patch.tools.quality_report draws the training-reward
#      and held-out curves (mean and min..max over seeds) and writes the table;
#   2. fidelity: jagg_patch.tools.fidelity on the trained models at upstream's geometry (S 16 / 20,
#      fraction 0.6, W 4), per group for both groupings (trained, window): cos(JAGG, exact) with
#      the timestep and the index alpha, and the endpoints ablation.
#
#   bash benchmarks/digits.sh                                  # both families, all tables (39 min on 2 cores)
#   MODELS=flux SEEDS=42 VARIANTS="vanilla jagg control" FIDELITY=0 bash benchmarks/digits.sh
#   PRESET=digits_large VARIANTS="vanilla jagg" bash benchmarks/digits.sh   # the less linear world
#
# Settings (besides benchmarks/common.sh): SEEDS ("42 43 44"), STEPS (60), EVAL_EVERY (10),
# EVAL_IMAGES (5 per prompt), EVAL_ARGS (extra evaluate flags), JOBS (2 training runs at once, one thread each), FIDELITY (1; 0
# skips part 2), FID_ROLLOUTS (3), FID_SAMPLES (32 samples per rollout), FID_GROUPINGS ("trained
# window"). VARIANTS default: vanilla jagg jagg_window authors endpoints control.
# Outputs ($PRESET is digits unless set): $OUT/$PRESET/quality/<model>/seed<S>/<variant>/ (runs),
# .../seed<S>/eval/ (scores), $OUT/$PRESET/quality/<model>/report/{curves.png,report.md,report.json},
# $OUT/$PRESET/fidelity_<grouping>/, and $OUT/$PRESET/$PRESET.md with every table and the run time of each part.
VARIANTS="${VARIANTS:-vanilla jagg jagg_window authors endpoints control}"
export PRESET="${PRESET:-digits}"   # before common.sh: it sets the cache folder and one thread per process
case "$PRESET" in digits|digits_large) ;; *) echo "error: PRESET=$PRESET: this script runs the digits worlds (PRESET=digits or digits_large)" >&2; exit 2 ;; esac
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
PASS_GEOMETRY=0   # train at the preset's own S 8 / fraction 0.6, as the shipped default run does
SEEDS="${SEEDS:-42 43 44}"
STEPS="${STEPS:-60}"
EVAL_EVERY="${EVAL_EVERY:-10}"
EVAL_IMAGES="${EVAL_IMAGES:-5}"
JOBS="${JOBS:-2}"
FIDELITY="${FIDELITY:-1}"
FID_GROUPINGS="${FID_GROUPINGS:-trained window}"
read -r -a EVAL_FLAGS <<< "${EVAL_ARGS:-}"   # extra evaluate flags, e.g. --mixed_precision bf16
DEST="$OUT/$PRESET"
mkdir -p "$DEST"
REPORT="$DEST/$PRESET.md"
{
  echo "# The $PRESET world"
  echo
  echo "$(machine_line)"
  echo "variants: $VARIANTS | seeds $SEEDS | $STEPS steps | W $JAGG_WINDOW | jagg_frac $JAGG_FRAC | $JOBS runs at once"
} > "$REPORT"

# Up to JOBS training runs at once; a failed run stops the script.
running=()
launch() {
  run_variant "$@" &
  running+=($!)
  if (( ${#running[@]} >= JOBS )); then
    wait "${running[0]}" || exit 1
    running=("${running[@]:1}")
  fi
}
drain() { for pid in "${running[@]}"; do wait "$pid" || exit 1; done; running=(); }

for model in $MODELS; do
  t0=$SECONDS
  root="$DEST/quality/$model"
  for seed in $SEEDS; do
    for variant in $VARIANTS; do
      launch "$model" "$variant" "$root/seed$seed/$variant" --max_train_steps "$STEPS" --seed "$seed" \
        --checkpointing_steps "$EVAL_EVERY" --sample_every 0
    done
  done
  drain
  t_train=$((SECONDS - t0))
  base_model="$("$PY" -c "import sys; from dancegrpo.presets import materialize_preset as m; print(m(sys.argv[1], sys.argv[2], '.'))" "$model" "$PRESET")"
  for seed in $SEEDS; do
    ckpts=(--checkpoint "base@0=$base_model")
    for variant in $VARIANTS; do
      for ((step = EVAL_EVERY; step <= STEPS; step += EVAL_EVERY)); do
        ckpts+=(--checkpoint "$variant@$step=$root/seed$seed/$variant/checkpoint-$step-0")
      done
    done
    echo "== $model / seed $seed / evaluate $(( ${#ckpts[@]} / 2 )) checkpoints" >&2
    "$PY" -m dancegrpo.evaluate --family "$model" --preset "$PRESET" --cache_dir "$CACHE_DIR" "${ckpts[@]}" \
      --metrics digit,digit_heldout --max_prompts 40 --num_images_per_prompt "$EVAL_IMAGES" --seed "$seed" \
      --output_dir "$root/seed$seed/eval" "${EVAL_FLAGS[@]}" > "$root/seed$seed/eval.log" 2>&1 \
      || { echo "error: evaluate failed; see $root/seed$seed/eval.log" >&2; tail -20 "$root/seed$seed/eval.log" >&2; exit 1; }
  done
  "$PY" -m jagg_patch.tools.quality_report "$root" --metric digit_heldout --out "$root/report" --variants "${VARIANTS// /,}" \
    --title "$PRESET world, $model: GRPO on the digit reward, seeds $SEEDS" > /dev/null
  {
    echo; echo "## Quality, $model ($((SECONDS - t0)) s: training $t_train s, evaluation $((SECONDS - t0 - t_train)) s)"; echo
    cat "$root/report/report.md"
    echo; echo "Curves: $root/report/curves.png"
  } >> "$REPORT"
done

if [[ "$FIDELITY" == 1 ]]; then
  for grouping in $FID_GROUPINGS; do
    t0=$SECONDS
    JAGG_GROUPING="$grouping" OUT="$DEST/fidelity_$grouping" PRESET="$PRESET" WINDOWS="$JAGG_WINDOW" \
      ROLLOUTS="${FID_ROLLOUTS:-3}" SAMPLES="${FID_SAMPLES:-32}" bash "$ROOT/benchmarks/fidelity.sh" > /dev/null
    { echo; echo "## Fidelity, grouping $grouping ($((SECONDS - t0)) s)"; echo
      sed '1,/^preset:/d' "$DEST/fidelity_$grouping/fidelity/fidelity.md"; } >> "$REPORT"
  done
fi
echo "wrote $REPORT" >&2
cat "$REPORT"
