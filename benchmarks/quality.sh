#!/usr/bin/env bash
# The paper's quality comparison: reward curves of vanilla / JAGG / endpoints ablation over the
# same steps and seeds, then the evaluation table (python -m dancegrpo.evaluate) of the final
# checkpoints.
#
#   bash benchmarks/quality.sh                         # GPUs: upstream recipes, 300 steps, HPSv2 reward
#   PRESET=tiny bash benchmarks/quality.sh             # CPU: the preset that learns in 30 steps (jpeg reward)
#   PRESET=tiny MODELS=flux SEEDS="42 43" bash benchmarks/quality.sh
#
# Settings (besides benchmarks/common.sh): STEPS (default: 30 with a preset, else the recipe's 300),
# SEEDS ("42"), MA_WINDOW (moving average, default 5 with a preset, else 10), EVAL_METRICS (default:
# the preset's reward, else hpsv2,pickscore,clipscore), EVAL_PROMPTS (number of prompts, default 8),
# EVAL_IMAGES (images per prompt, default 2), EVAL_ARGS (extra evaluate flags, e.g. --hps_ckpt_dir,
# --pickscore_model_path, --clipscore_model_path, --prompt_file).
# Outputs under $OUT/quality/<model>/seed<S>/: one run folder per variant (metrics.jsonl,
# checkpoint), compare/ (reward curves PNG, rewards.csv, comparison.{json,csv,md}), eval/
# (table.md, comparison.json, per-image scores.csv). $OUT/quality/quality.md collects the tables.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# Train with the preset's / recipe's own geometry (the tiny preset learns at its S = 8; the GPU
# recipes already use S 16 / 20 and fraction 0.6).
PASS_GEOMETRY="${PASS_GEOMETRY:-0}"
STEPS="${STEPS:-$([[ -n "$PRESET" ]] && echo 30 || echo 300)}"
SEEDS="${SEEDS:-42}"
MA_WINDOW="${MA_WINDOW:-$([[ -n "$PRESET" ]] && echo 5 || echo 10)}"
EVAL_PROMPTS="${EVAL_PROMPTS:-8}"
EVAL_IMAGES="${EVAL_IMAGES:-2}"
read -r -a EVAL_EXTRA <<< "${EVAL_ARGS:-}"
DEST="$OUT/quality"
mkdir -p "$DEST"
REPORT="$DEST/quality.md"
{
  echo "# Quality benchmark"
  echo
  echo "$(machine_line)"
  echo "preset: ${PRESET:-none (real weights)} | window $JAGG_WINDOW | jagg_frac $JAGG_FRAC | $STEPS steps | seeds $SEEDS${SIZE_ARGS:+ | extra flags: $SIZE_ARGS}"
} > "$REPORT"

for model in $MODELS; do
  for seed in $SEEDS; do
    base="$DEST/$model/seed$seed"
    dirs=(); labels=(); ckpts=()
    for variant in $VARIANTS; do
      run_variant "$model" "$variant" "$base/$variant" --max_train_steps "$STEPS" --seed "$seed"
      dirs+=("$base/$variant"); labels+=("$variant")
      ckpt="$base/$variant/checkpoint-$STEPS-0"
      [[ -d "$ckpt" ]] || { echo "error: $ckpt not written" >&2; exit 1; }
      ckpts+=(--checkpoint "$variant=$ckpt")
    done
    labels_csv="$(IFS=,; echo "${labels[*]}")"
    "$PY" -m jagg_patch.tools.compare "${dirs[@]}" --labels "$labels_csv" --out "$base/compare" \
      --ma_window "$MA_WINDOW" > /dev/null
    if [[ -n "$PRESET" ]]; then
      src=(--preset "$PRESET" --cache_dir "$CACHE_DIR")   # the preset's S and size
    else
      src=(--pretrained_model_name_or_path "${MODEL_PATH:-data/$model}"
           --data_json_path "${DATA_JSON:-data/${model}_rl_embeddings/videos2caption.json}"
           --sampling_steps "$(sampling_steps "$model")")
    fi
    metrics=()
    [[ -n "${EVAL_METRICS:-}" ]] && metrics=(--metrics "$EVAL_METRICS")
    [[ -z "$PRESET" && -z "${EVAL_METRICS:-}" ]] && metrics=(--metrics hpsv2,pickscore,clipscore)
    echo "== $model / seed $seed / evaluate" >&2
    "$PY" -m dancegrpo.evaluate --family "$model" "${src[@]}" "${ckpts[@]}" "${metrics[@]}" \
      --max_prompts "$EVAL_PROMPTS" \
      --num_images_per_prompt "$EVAL_IMAGES" --seed "$seed" --output_dir "$base/eval" "${EVAL_EXTRA[@]}" \
      > "$base/eval.log" 2>&1 \
      || { echo "error: evaluate failed; see $base/eval.log" >&2; tail -20 "$base/eval.log" >&2; exit 1; }
    {
      echo; echo "## $model, seed $seed: training rewards (MA over $MA_WINDOW steps)"; echo
      cat "$base/compare/comparison.md"
      echo; echo "Reward curves: $base/compare/reward_curves.png"
      echo; echo "## $model, seed $seed: evaluation of the step-$STEPS checkpoints"; echo
      cat "$base/eval/table.md"
    } >> "$REPORT"
  done
done
echo "wrote $REPORT" >&2
cat "$REPORT"
