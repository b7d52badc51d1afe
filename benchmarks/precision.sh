#!/usr/bin/env bash
# What bf16 does to JAGG (docs/jagg.md, "JAGG in bf16"), with jagg_patch.tools.precision on the trained
# digits worlds, per world and family, one rollout each (the generators of training step 1):
#   1. the on-policy ratio at the first update and the transitions outside the clip range, vanilla /
#      JAGG without reuse / JAGG with the rollout's outputs: in float32 with upstream's update micro-batch
#      of one (the rollout batches 128), in bf16, and with a bf16 rollout rescored in float32 (a recompute
#      rounded otherwise than the rollout, as another kernel's can be on a GPU);
#   2. per group position, cos(JAGG in bf16, exact float64) beside cos(exact in bf16, exact float64) and
#      JAGG's own error in float64, over PREC_SAMPLES samples.
#
#   bash benchmarks/precision.sh                         # both worlds, both families
#   WORLDS=digits_large MODELS=flux bash benchmarks/precision.sh
#
# Settings (besides benchmarks/common.sh): WORLDS ("digits digits_large"), JAGG_WINDOW (4), PREC_SAMPLES (32).
# Outputs: $OUT/precision/<world>/<model>/{f32_mb1,bf16,bf16_rescored_f32}.{json,md}, $OUT/precision/precision.md.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
WORLDS="${WORLDS:-digits digits_large}"
PREC_SAMPLES="${PREC_SAMPLES:-32}"
DEST="$OUT/precision"
mkdir -p "$DEST"
REPORT="$DEST/precision.md"
{ echo "# What bf16 does to JAGG"; echo; echo "$(machine_line)"
  echo "worlds: $WORLDS | models: $MODELS | W $JAGG_WINDOW, every group through JAGG | $PREC_SAMPLES samples"; } > "$REPORT"

module_of() { [[ "$1" == flux ]] && echo dancegrpo.train_grpo_flux || echo dancegrpo.train_grpo_qwenimage; }

# run NAME WORLD MODEL [flags...]
run() {
  local name="$1" world="$2" model="$3"; shift 3
  local dir="$DEST/$world/$model"
  mkdir -p "$dir"
  echo "== $world / $model / $name" >&2
  local t0=$SECONDS
  "$PY" -m jagg_patch.tools.precision "$(module_of "$model")" --preset "$world" --cache_dir "$CACHE_DIR" \
    --output_dir "$dir/run_$name" "${SIZE[@]}" --jagg_window "$JAGG_WINDOW" --jagg_frac 1 --prec_samples "$PREC_SAMPLES" \
    --prec_json "$dir/$name.json" --prec_md "$dir/$name.md" "$@" > "$dir/$name.log" 2>&1 \
    || { echo "error: $world / $model / $name failed; see $dir/$name.log" >&2; tail -20 "$dir/$name.log" >&2; exit 1; }
  { echo; echo "### $world, $model: $name ($((SECONDS - t0)) s)"; echo; cat "$dir/$name.md"; } >> "$REPORT"
}

for world in $WORLDS; do
  for model in $MODELS; do
    run f32_mb1 "$world" "$model" --mixed_precision no --update_batch_size 1 --prec_parts ratio
    run bf16 "$world" "$model" --mixed_precision bf16
    run bf16_rescored_f32 "$world" "$model" --mixed_precision bf16 --prec_update_precision no --prec_parts ratio
  done
done
echo "wrote $REPORT" >&2
cat "$REPORT"
