#!/usr/bin/env bash
# DanceGRPO on Qwen-Image: upstream's recipe (scripts/finetune/finetune_qwenimage_grpo.sh) as defaults.
#
#   bash train_qwenimage.sh                      # 8 GPUs, weights in data/qwenimage, embeddings from preprocessing
#   JAGG=1 bash train_qwenimage.sh               # same, with the JAGG patch (python -m jagg_patch ...)
#   PRESET=tiny bash train_qwenimage.sh          # embedded tiny models on CPU, 1 process, no weights needed
#   NPROC=4 OUTPUT_DIR=runs/q bash train_qwenimage.sh --max_train_steps 10   # extra flags pass through
#
# Every value below can be overridden by an environment variable of the same name.
set -euo pipefail

PRESET="${PRESET:-}"
JAGG="${JAGG:-0}"
JAGG_WINDOW="${JAGG_WINDOW:-4}"
JAGG_FRAC="${JAGG_FRAC:-0.6}"
JAGG_MODE="${JAGG_MODE:-jagg}"
MODULE="dancegrpo.train_grpo_qwenimage"
# Single node by default; e.g. TORCHRUN_ARGS="--nnodes=2 --node_rank=0 --master_addr=H --master_port=29500".
read -r -a TORCHRUN_EXTRA <<< "${TORCHRUN_ARGS:---standalone}"

if [[ -n "$PRESET" ]]; then
  NPROC="${NPROC:-1}"
  OUTPUT_DIR="${OUTPUT_DIR:-outputs/qwenimage_${PRESET}}"
  CACHE_DIR="${CACHE_DIR:-./cache_dir}"
  ARGS=(--preset "$PRESET" --cache_dir "$CACHE_DIR" --output_dir "$OUTPUT_DIR")
else
  NPROC="${NPROC:-8}"
  MODEL_PATH="${MODEL_PATH:-data/qwenimage}"
  DATA_JSON="${DATA_JSON:-data/qwenimage_rl_embeddings/videos2caption.json}"
  OUTPUT_DIR="${OUTPUT_DIR:-data/outputs/grpo_qwenimage}"
  CACHE_DIR="${CACHE_DIR:-data/.cache}"
  missing=()
  for f in transformer/config.json vae/config.json; do
    [[ -f "$MODEL_PATH/$f" ]] || missing+=("$MODEL_PATH/$f")
  done
  if (( ${#missing[@]} )); then
    cat >&2 <<MSG
error: Qwen-Image weights not found (missing: ${missing[*]}).
  Put the diffusers folder of Qwen/Qwen-Image at MODEL_PATH=$MODEL_PATH, i.e.
    $MODEL_PATH/transformer/  (config.json + safetensors)   $MODEL_PATH/vae/
    $MODEL_PATH/text_encoder/ and $MODEL_PATH/tokenizer/     (for preprocessing)
  e.g.  huggingface-cli download Qwen/Qwen-Image --local-dir $MODEL_PATH
  then  python -m dancegrpo.preprocess.qwenimage --model_path $MODEL_PATH --prompt_dir prompts.txt
  Or run the embedded tiny preset on CPU instead:  PRESET=tiny bash $0
MSG
    exit 1
  fi
  if [[ ! -f "$DATA_JSON" ]]; then
    echo "error: prompt embeddings $DATA_JSON not found. Create them with" >&2
    echo "  python -m dancegrpo.preprocess.qwenimage --model_path $MODEL_PATH --prompt_dir prompts.txt" \
         "--output_dir $(dirname "$DATA_JSON")   (or set DATA_JSON)" >&2
    exit 1
  fi
  # Upstream's Qwen-Image recipe (see ../shared/DANCEGRPO.md, the table).
  ARGS=(
    --seed "${SEED:-42}"
    --pretrained_model_name_or_path "$MODEL_PATH"
    --vae_model_path "${VAE_MODEL_PATH:-$MODEL_PATH}"
    --cache_dir "$CACHE_DIR"
    --data_json_path "$DATA_JSON"
    --output_dir "$OUTPUT_DIR"
    --gradient_checkpointing
    --selective_checkpointing "${SELECTIVE_CHECKPOINTING:-0.5}"
    --train_batch_size "${TRAIN_BATCH_SIZE:-2}"
    --num_latent_t 1 --sp_size 1 --train_sp_batch_size 1
    --dataloader_num_workers "${DATALOADER_NUM_WORKERS:-4}"
    --gradient_accumulation_steps "${GRADIENT_ACCUMULATION_STEPS:-12}"
    --max_train_steps "${MAX_TRAIN_STEPS:-300}"
    --learning_rate "${LEARNING_RATE:-1e-5}"
    --mixed_precision bf16
    --checkpointing_steps "${CHECKPOINTING_STEPS:-60}"
    --allow_tf32
    --cfg 0.0
    --h "${HEIGHT:-720}" --w "${WIDTH:-720}" --t 1
    --sampling_steps "${SAMPLING_STEPS:-20}"
    --eta "${ETA:-0.3}"
    --lr_warmup_steps 0
    --sampler_seed "${SAMPLER_SEED:-12627}"
    --max_grad_norm "${MAX_GRAD_NORM:-1.0}"
    --weight_decay 0.0001
    --reward "${REWARD:-hpsv2=1.0}"
    --num_generations "${NUM_GENERATIONS:-12}"
    --shift "${SHIFT:-3}"
    --use_group
    --ignore_last
    --timestep_fraction "${TIMESTEP_FRACTION:-0.6}"
    --init_same_noise
    --clip_range "${CLIP_RANGE:-1e-4}"
    --adv_clip_max "${ADV_CLIP_MAX:-5.0}"
  )
fi

if [[ "$JAGG" == "1" ]]; then
  LAUNCH=(-m jagg_patch "$MODULE" --jagg_window "$JAGG_WINDOW" --jagg_frac "$JAGG_FRAC" --jagg_mode "$JAGG_MODE")
elif [[ "$JAGG" == "0" ]]; then
  LAUNCH=(-m "$MODULE")
else
  echo "error: JAGG must be 0 (vanilla) or 1 (JAGG patch), got '$JAGG'" >&2
  exit 2
fi

set -x
exec torchrun "${TORCHRUN_EXTRA[@]}" --nproc_per_node="$NPROC" "${LAUNCH[@]}" "${ARGS[@]}" "$@"
