#!/usr/bin/env bash
# The paper's Flow-GRPO-Fast row: update-phase time of Flow-GRPO-Fast vs Flow-GRPO-Fast + JAGG (the
# window's K transitions as one group), whole-step times and backward counts, each model's
# Flow-GRPO-Fast recipe (ALGO=flow_grpo_fast in the train scripts) at a window where JAGG applies.
#
#   PRESET=small bash benchmarks/flow_grpo_fast.sh     # CPU, embedded models
#   bash benchmarks/flow_grpo_fast.sh                  # GPUs, real weights (the train scripts' settings)
#
# FAST_K (3): the window. Flux's recipe window is 3; Qwen-Image's is 2, where JAGG is exact and saves
# nothing, so K=3 is measured for both (Qwen-Image's range (0, 5) holds it). JAGG runs with W = K and
# jagg_frac 1 (the window is one group). Modes: vanilla, jagg (joint), jagg_split, and both with
# the rollout's outputs reused; in ONE process on one rollout (jagg_patch.tools.bench_update). Output:
# $OUT/flow_grpo_fast/<model>/bench_update.{json,md} and $OUT/flow_grpo_fast/flow_grpo_fast.md.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
FAST_K="${FAST_K:-3}"
BENCH_REPS="${BENCH_REPS:-3}"
BENCH_MODES="${BENCH_MODES:-vanilla,jagg,jagg_split,jagg_reuse,jagg_split_reuse}"
DEST="$OUT/flow_grpo_fast"
mkdir -p "$DEST"
REPORT="$DEST/flow_grpo_fast.md"
{ echo "# Flow-GRPO-Fast + JAGG (window K=$FAST_K)"; echo; echo "$(machine_line)"; echo "preset: ${PRESET:-none (real weights)}"; } > "$REPORT"
for model in $MODELS; do
  echo "== $model / Flow-GRPO-Fast update-phase micro-benchmark" >&2
  mkdir -p "$DEST/$model"
  ALGO=flow_grpo_fast JAGG=1 JAGG_LAUNCHER=jagg_patch.tools.bench_update JAGG_WINDOW="$FAST_K" JAGG_FRAC=1.0 \
    OUTPUT_DIR="$DEST/$model/bench_run" bash "$(train_script "$model")" --sde_window_size "$FAST_K" "${SIZE[@]}" \
    --bench_reps "$BENCH_REPS" --bench_modes "$BENCH_MODES" --bench_target_update 0.299 \
    --bench_json "$DEST/$model/bench_update.json" --bench_md "$DEST/$model/bench_update.md" \
    > "$DEST/$model/bench_update.log" 2>&1 \
    || { echo "error: $model failed; see $DEST/$model/bench_update.log" >&2; tail -20 "$DEST/$model/bench_update.log" >&2; exit 1; }
  { echo; cat "$DEST/$model/bench_update.md"; } >> "$REPORT"
done
echo "wrote $REPORT" >&2
cat "$REPORT"
