# Shared launcher for train_flux.sh and train_qwenimage.sh (sourced, not run).
#
# The caller sets: MODULE (trainer module), MODEL_NAME, HF_REPO, PREPROCESS (module),
# MODEL_PATH, DATA_JSON, OUTPUT_DIR, CACHE_DIR, NPROC_DEFAULT, and the array MODEL_RECIPE
# (upstream's flags where the models differ; COMMON_RECIPE below holds the shared ones).
# This file handles the preset switch, the missing-weights message, the vanilla / JAGG switch, and the torchrun call, so
# vanilla and JAGG runs differ in nothing but the launcher module.
set -euo pipefail

# Upstream's settings common to both recipes (docs/gpu_training.md).
COMMON_RECIPE=(
  --seed "${SEED:-42}"
  --gradient_checkpointing
  --train_batch_size "${TRAIN_BATCH_SIZE:-2}"
  --num_latent_t 1 --sp_size 1 --train_sp_batch_size "${TRAIN_SP_BATCH_SIZE:-1}"
  --dataloader_num_workers "${DATALOADER_NUM_WORKERS:-4}"
  --gradient_accumulation_steps "${GRADIENT_ACCUMULATION_STEPS:-12}"
  --max_train_steps "${MAX_TRAIN_STEPS:-300}"
  --learning_rate "${LEARNING_RATE:-1e-5}"
  --mixed_precision bf16
  --allow_tf32
  --cfg 0.0
  --h "${HEIGHT:-720}" --w "${WIDTH:-720}" --t 1
  --eta "${ETA:-0.3}"
  --lr_warmup_steps 0
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

PRESET="${PRESET:-}"
JAGG="${JAGG:-0}"
JAGG_WINDOW="${JAGG_WINDOW:-4}"
JAGG_FRAC="${JAGG_FRAC:-0.6}"
JAGG_MODE="${JAGG_MODE:-jagg}"
JAGG_GROUPING="${JAGG_GROUPING:-trained}"   # trained (the paper) | window (the authors' code)
JAGG_ALPHA="${JAGG_ALPHA:-timestep}"        # timestep (the paper) | index (the authors' code)
JAGG_BACKWARD="${JAGG_BACKWARD:-auto}"      # auto: batched on several ranks, split on one | joint (the paper) | split (the authors' code) | batched
JAGG_REUSE_ROLLOUT="${JAGG_REUSE_ROLLOUT:-on_policy}"  # off | on_policy (exact) | always (stale after a step)
# With JAGG=1, the module that takes "TRAINER --jagg_* flags ...": jagg_patch (training), or the
# benchmarks' jagg_patch.tools.bench_update / jagg_patch.tools.fidelity, which so run with the same recipe.
JAGG_LAUNCHER="${JAGG_LAUNCHER:-jagg_patch}"
# Nodes: one by default (torchrun --standalone). With NNODES > 1, run the same command on every
# node with its NODE_RANK (0..NNODES-1) and the MASTER_ADDR / MASTER_PORT of node 0; NPROC is
# per node. TORCHRUN_ARGS, when set, replaces all of this.
NNODES="${NNODES:-1}"
# torchrun through dancegrpo.launch: a SIGTERM / SIGINT to it stops the workers (each saves a
# checkpoint) and exits 128+signal, not 1 with a traceback. TORCHRUN replaces the command.
read -r -a LAUNCHER <<< "${TORCHRUN:-python3 -m dancegrpo.launch}"
if [[ -n "${TORCHRUN_ARGS:-}" ]]; then
  read -r -a TORCHRUN_EXTRA <<< "${TORCHRUN_ARGS}"
elif [[ "$NNODES" == "1" ]]; then
  TORCHRUN_EXTRA=(--standalone)
else
  if [[ -z "${NODE_RANK:-}" || -z "${MASTER_ADDR:-}" ]]; then
    echo "error: NNODES=$NNODES needs NODE_RANK (0..$((NNODES - 1)), this node's) and MASTER_ADDR (node 0's" \
         "address) on every node, e.g. NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash $0" >&2
    exit 2
  fi
  TORCHRUN_EXTRA=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR"
                  --master_port="${MASTER_PORT:-29500}")
fi

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
        --output_dir "$OUTPUT_DIR" --cache_dir "$CACHE_DIR" "${COMMON_RECIPE[@]}" "${MODEL_RECIPE[@]}")
fi

# ENGINE=deepspeed: DeepSpeed ZeRO instead of FSDP, with DEEPSPEED_CONFIG (default: the shipped ZeRO-2 config).
case "${ENGINE:-fsdp}" in
  fsdp) ;;
  deepspeed) ARGS+=(--engine deepspeed --deepspeed_config "${DEEPSPEED_CONFIG:-$(dirname "${BASH_SOURCE[0]}")/../configs/deepspeed/zero2.json}") ;;
  *) echo "error: ENGINE must be fsdp or deepspeed, got '${ENGINE}'" >&2; exit 2 ;;
esac

# ALGO=flow_grpo_fast: Flow-GRPO-Fast's recipe (FAST_RECIPE, set by the calling train script: the
# SDE window, kernel, noise level, clip range and Flow-GRPO's advantage) on top of the model's.
case "${ALGO:-dancegrpo}" in
  dancegrpo) ;;
  flow_grpo_fast) ARGS+=("${FAST_RECIPE[@]}") ;;
  *) echo "error: ALGO must be dancegrpo or flow_grpo_fast, got '${ALGO}'" >&2; exit 2 ;;
esac

# LORA=1: train a LoRA adapter (dancegrpo.adapters.lora); the LoRA entry module and recipe are the caller's.
case "${LORA:-0}" in
  1) ARGS+=(--use_lora --lora_rank "${LORA_RANK:-128}" --lora_alpha "${LORA_ALPHA:-256}"
            --lora_target_modules "${LORA_TARGET_MODULES:-to_q,to_k,to_v,to_out.0}") ;;
  0) ;;
  *) echo "error: LORA must be 0 (full fine-tune) or 1 (LoRA adapter), got '${LORA}'" >&2; exit 2 ;;
esac

if [[ "$JAGG" == "1" ]]; then
  LAUNCH=(-m "$JAGG_LAUNCHER" "$MODULE" --jagg_window "$JAGG_WINDOW" --jagg_frac "$JAGG_FRAC" --jagg_mode "$JAGG_MODE"
          --jagg_grouping "$JAGG_GROUPING" --jagg_alpha "$JAGG_ALPHA" --jagg_backward "$JAGG_BACKWARD"
          --jagg_reuse_rollout "$JAGG_REUSE_ROLLOUT")
elif [[ "$JAGG" == "0" ]]; then
  LAUNCH=(-m "$MODULE")
else
  echo "error: JAGG must be 0 (vanilla) or 1 (JAGG patch), got '$JAGG'" >&2
  exit 2
fi

set -x
exec "${LAUNCHER[@]}" "${TORCHRUN_EXTRA[@]}" --nproc_per_node="$NPROC" "${LAUNCH[@]}" "${ARGS[@]}" "$@"
