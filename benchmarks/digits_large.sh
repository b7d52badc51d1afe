#!/usr/bin/env bash
# The table that decides how to use JAGG, in the digits_large world (--preset digits_large: deeper
# models trained at upstream's geometry, S 16 Flux / S 20 Qwen-Image, fraction 0.6):
#   1. quality and fidelity: benchmarks/digits.sh with PRESET=digits_large (every VARIANT x SEED,
#      STEPS steps, the held-out rate of checkpoints, the fidelity profile per position);
#   2. speed: for each variant, jagg_patch.tools.bench_update times it side by side with vanilla in
#      ONE process on one rollout (auto's monitor included, at the runs' cadence);
#   3. jagg_patch.tools.tradeoff joins both: held-out rate (mean ± sd), whole-step ratio, backwards per
#      step, the routing auto chose and when it changed; the verdicts; pareto.png per family.
#
#   bash benchmarks/digits_large.sh                              # both families (see REPRODUCE.md for the time)
#   MODELS=flux SEEDS=42 VARIANTS="vanilla jagg jagg_auto" bash benchmarks/digits_large.sh
#
# Settings (besides benchmarks/common.sh and benchmarks/digits.sh's): VARIANTS (default below),
# STRICT_MIN_COS (0.99, auto's second threshold), BENCH_REPS (3), BENCH_UNIT_REPS (3), QUALITY (1; 0 reuses part 1's
# runs already in $OUT/digits_large), GOAL_RATIO (0.6: a whole step 40% shorter than vanilla's).
# Outputs: $OUT/digits_large/ (part 1, as digits.sh writes it), $OUT/digits_large/speed/<model>/<variant>.json,
# $OUT/digits_large/tradeoff/<model>/{tradeoff.md,tradeoff.json,pareto.png}, $OUT/digits_large/tradeoff.md.
export PRESET=digits_large
export VARIANTS="${VARIANTS:-vanilla jagg jagg_frac1 jagg_w8 jagg_auto jagg_auto_strict jagg_w8_auto jagg_w8_auto_strict endpoints}"
export STRICT_MIN_COS="${STRICT_MIN_COS:-0.99}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BENCH_REPS="${BENCH_REPS:-3}"
BENCH_UNIT_REPS="${BENCH_UNIT_REPS:-3}"
QUALITY="${QUALITY:-1}"
GOAL_RATIO="${GOAL_RATIO:-0.6}"
DEST="$OUT/digits_large"

[[ "$QUALITY" == 1 ]] && bash "$ROOT/benchmarks/digits.sh" > /dev/null

# bench_flags VARIANT -> the bench_update flags and mode that run what the variant's training runs ran
# (one process: the backward `auto` is split; the rollout's outputs reused, as run_variant trains).
bench_flags() {
  local reuse=jagg_split_reuse every="--jagg_monitor_every ${MONITOR_EVERY:-10}"
  case "$1" in
    jagg) echo "--jagg_window 4 --jagg_frac 0.6 $reuse" ;;
    jagg_frac1) echo "--jagg_window 4 --jagg_frac 1.0 $reuse" ;;
    jagg_w8) echo "--jagg_window 8 --jagg_frac 1.0 $reuse" ;;
    jagg_auto) echo "--jagg_window 4 --jagg_frac 1.0 $every ${reuse}_auto" ;;
    jagg_auto_strict) echo "--jagg_window 4 --jagg_frac 1.0 --jagg_min_cos $STRICT_MIN_COS $every ${reuse}_auto" ;;
    jagg_w8_auto) echo "--jagg_window 8 --jagg_frac 1.0 $every ${reuse}_auto" ;;
    jagg_w8_auto_strict) echo "--jagg_window 8 --jagg_frac 1.0 --jagg_min_cos $STRICT_MIN_COS $every ${reuse}_auto" ;;
    endpoints) echo "--jagg_window 4 --jagg_frac 0.6 endpoints" ;;
    *) echo "error: no bench configuration for variant '$1'" >&2; exit 2 ;;
  esac
}

module_of() { [[ "$1" == flux ]] && echo dancegrpo.train_grpo_flux || echo dancegrpo.train_grpo_qwenimage; }

{ echo "# How to use JAGG in the digits_large world"; echo; echo "$(machine_line)"
  echo "variants: $VARIANTS | seeds ${SEEDS:-42 43 44} | ${STEPS:-60} steps | auto's second threshold $STRICT_MIN_COS"; } \
  > "$DEST/tradeoff.md"
for model in $MODELS; do
  t0=$SECONDS
  benches=()
  for variant in $VARIANTS; do
    [[ "$variant" == vanilla || "$variant" == control ]] && continue
    read -r -a flags <<< "$(bench_flags "$variant")"
    mode="${flags[-1]}"; unset 'flags[-1]'
    json="$DEST/speed/$model/$variant.json"
    mkdir -p "$(dirname "$json")"
    echo "== $model / bench $variant ($mode)" >&2
    "$PY" -m jagg_patch.tools.bench_update "$(module_of "$model")" --preset digits_large --cache_dir "$CACHE_DIR" \
      --output_dir "$DEST/speed/$model/run_$variant" "${SIZE[@]}" "${flags[@]}" --bench_modes "vanilla,$mode" \
      --bench_reps "$BENCH_REPS" --bench_unit_reps "$BENCH_UNIT_REPS" --bench_json "$json" > "$json.log" 2>&1 \
      || { echo "error: bench_update failed; see $json.log" >&2; tail -20 "$json.log" >&2; exit 1; }
    benches+=(--bench "$variant=$json:$mode")
  done
  "$PY" -m jagg_patch.tools.tradeoff "$DEST/quality/$model" "${benches[@]}" --goal_ratio "$GOAL_RATIO" \
    --out "$DEST/tradeoff/$model" --title "digits_large, $model" > /dev/null
  { echo; echo "## $model (speed and table: $((SECONDS - t0)) s)"; echo
    cat "$DEST/tradeoff/$model/tradeoff.md"; echo; echo "Pareto picture: $DEST/tradeoff/$model/pareto.png"; } \
    >> "$DEST/tradeoff.md"
done
echo "wrote $DEST/tradeoff.md" >&2
cat "$DEST/tradeoff.md"
