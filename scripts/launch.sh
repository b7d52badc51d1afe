# Shared launcher for train_flux.sh and train_qwenimage.sh (sourced, not run).
#
# The caller sets: MODULE (trainer module), MODEL_NAME, HF_REPO, PREPROCESS (module),
# MODEL_PATH, DATA_JSON, OUTPUT_DIR, CACHE_DIR, NPROC_DEFAULT, and the array RECIPE
# (upstream's flags for that model). This file handles the preset switch, the
# missing-weights message, the vanilla / JAGG switch, and the torchrun call, so
# vanilla and JAGG runs differ in nothing but the launcher module.
set -euo pipefail

PRESET="${PRESET:-}"
JAGG="${JAGG:-0}"
JAGG_WINDOW="${JAGG_WINDOW:-4}"
JAGG_FRAC="${JAGG_FRAC:-0.6}"
JAGG_MODE="${JAGG_MODE:-jagg}"
# With JAGG=1, the module that takes "TRAINER --jagg_* flags ...": jagg_patch (training), or the
# benchmarks' jagg_patch.bench_update / jagg_patch.fidelity, which so run with the same recipe.
JAGG_LAUNCHER="${JAGG_LAUNCHER:-jagg_patch}"
# Single node by default; e.g. TORCHRUN_ARGS="--nnodes=2 --node_rank=0 --master_addr=H --master_port=29500".
read -r -a TORCHRUN_EXTRA <<< "${TORCHRUN_ARGS:---standalone}"

if [[ -n "$PRESET" ]]; then
  NPROC="${NPROC:-1}"
  OUTPUT_DIR="${OUTPUT_DIR_PRESET}"
  ARGS=(--preset "$PRESET" --cache_dir "${CACHE_DIR_PRESET}" --output_dir "$OUTPUT_DIR")
else
  NPROC="${NPROC:-$NPROC_DEFAULT}"
  missing=()
  for f in transformer/config.json vae/config.json; do
    [[ -f "$MODEL_PATH/$f" ]] || missing+=("$MODEL_PATH/$f")
  done
  if (( ${#missing[@]} )); then
    cat >&2 <<MSG
error: $MODEL_NAME weights not found (missing: ${missing[*]}).
  Put the diffusers folder of $HF_REPO at MODEL_PATH=$MODEL_PATH, i.e.
    $MODEL_PATH/transformer/  (config.json + safetensors)   $MODEL_PATH/vae/
    $MODEL_PATH/text_encoder*/ and $MODEL_PATH/tokenizer*/   (for preprocessing)
  e.g.  huggingface-cli download $HF_REPO --local-dir $MODEL_PATH
  then  python -m $PREPROCESS --model_path $MODEL_PATH --prompt_dir prompts.txt
  Or run the embedded tiny preset on CPU instead:  PRESET=tiny bash $0
MSG
    exit 1
  fi
  if [[ ! -f "$DATA_JSON" ]]; then
    echo "error: prompt embeddings $DATA_JSON not found. Create them with" >&2
    echo "  python -m $PREPROCESS --model_path $MODEL_PATH --prompt_dir prompts.txt" \
         "--output_dir $(dirname "$DATA_JSON")   (or set DATA_JSON)" >&2
    exit 1
  fi
  ARGS=(--pretrained_model_name_or_path "$MODEL_PATH" --data_json_path "$DATA_JSON"
        --output_dir "$OUTPUT_DIR" --cache_dir "$CACHE_DIR" "${RECIPE[@]}")
fi

if [[ "$JAGG" == "1" ]]; then
  LAUNCH=(-m "$JAGG_LAUNCHER" "$MODULE" --jagg_window "$JAGG_WINDOW" --jagg_frac "$JAGG_FRAC" --jagg_mode "$JAGG_MODE")
elif [[ "$JAGG" == "0" ]]; then
  LAUNCH=(-m "$MODULE")
else
  echo "error: JAGG must be 0 (vanilla) or 1 (JAGG patch), got '$JAGG'" >&2
  exit 2
fi

set -x
exec torchrun "${TORCHRUN_EXTRA[@]}" --nproc_per_node="$NPROC" "${LAUNCH[@]}" "${ARGS[@]}" "$@"
