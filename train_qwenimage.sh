#!/usr/bin/env bash
# DanceGRPO on Qwen-Image: upstream's recipe (scripts/finetune/finetune_qwenimage_grpo.sh) as defaults.
#
#   bash train_qwenimage.sh                      # 8 GPUs, weights in data/qwenimage, embeddings from preprocessing
#   JAGG=1 bash train_qwenimage.sh               # same, with the JAGG patch (python -m jagg_patch ...)
#   LORA=1 bash train_qwenimage.sh               # a LoRA adapter (r 128, alpha 256, lr 3e-4: Flux's LoRA recipe;
#                                                # upstream has no Qwen-Image LoRA trainer)
#   PRESET=tiny bash train_qwenimage.sh          # embedded tiny models on CPU, 1 process, no weights needed
#   NPROC=4 OUTPUT_DIR=runs/q bash train_qwenimage.sh --max_train_steps 10   # extra flags pass through
#   RECIPE=authors_standard bash train_qwenimage.sh   # the JAGG authors' run_standard.sh (vanilla baseline)
#   RECIPE=authors_jagg bash train_qwenimage.sh       # the JAGG authors' run_jagg.sh (their JAGG variant)
#
# Every value below can be overridden by an environment variable of the same name;
# JAGG=0|1, JAGG_WINDOW, JAGG_FRAC, JAGG_MODE, JAGG_GROUPING, JAGG_ALPHA, JAGG_BACKWARD, JAGG_REUSE_ROLLOUT, NPROC,
# TORCHRUN_ARGS: see scripts/launch.sh.
set -euo pipefail
# RECIPE: upstream (default, DanceGRPO's Qwen-Image recipe) or the first JAGG author's scripts
# (SchumiDing/eff_grpo, Qwen-Image, 8 GPUs). Their values become the defaults
# below; environment variables still win.
RUN_SUFFIX=""
case "${RECIPE:-upstream}" in
  upstream) ;;
  authors_standard|authors_jagg)
    RUN_SUFFIX="_${RECIPE}"   # their two runs get their own default output folders
    : "${TRAIN_BATCH_SIZE:=8}" "${GRADIENT_ACCUMULATION_STEPS:=8}" "${MAX_TRAIN_STEPS:=2000}"
    : "${CHECKPOINTING_STEPS:=25}" "${MAX_GRAD_NORM:=10.0}" "${CLIP_RANGE:=0.1}" "${SAMPLER_SEED:=12627}"
    # Their flag is --selective_checkpointing 0.0. Here 0.0 recomputes no block; upstream's Qwen
    # trainer, which theirs forks, checkpoints every block whatever the flag says
    # (upstream's): SELECTIVE_CHECKPOINTING=1.0 gives that memory / speed profile.
    : "${SELECTIVE_CHECKPOINTING:=0.0}"
    if [[ "${RECIPE}" == authors_standard ]]; then
      : "${SAMPLING_STEPS:=20}" "${NUM_GENERATIONS:=8}"
    else
      # run_jagg.sh's comment says a window of 5; its flag (--sum_sample) says 4: the flag is taken.
      : "${SAMPLING_STEPS:=21}" "${NUM_GENERATIONS:=12}" "${JAGG:=1}" "${JAGG_WINDOW:=4}" "${JAGG_FRAC:=1.0}"
      : "${JAGG_GROUPING:=window}" "${JAGG_ALPHA:=index}" "${JAGG_BACKWARD:=split}" "${JAGG_REUSE_ROLLOUT:=off}"
    fi ;;
  *) echo "error: RECIPE must be upstream, authors_standard or authors_jagg, got '${RECIPE}'" >&2; exit 2 ;;
esac
MODULE="dancegrpo.train_grpo_qwenimage"
# ALGO=flow_grpo_fast: Flow-GRPO-Fast's Qwen-Image config: 10 steps, a
# window of 2 drawn in (0, 5), Flow-GRPO's sde kernel at 1.2, clip 1e-4, Flow-GRPO's advantage;
# LoRA r 64 / alpha 128. Upstream's fixed (3, 5) window (a reseeding bug) is not reproduced.
FAST_RECIPE=(--sampling_steps "${SAMPLING_STEPS:-10}" --sde_window_size "${SDE_WINDOW_SIZE:-2}"
             --sde_window_range 0 5 --sde_type flow_grpo --eta "${ETA:-1.2}" --clip_range "${CLIP_RANGE:-1e-4}"
             --advantage flow_grpo)
[[ "${ALGO:-}" != flow_grpo_fast ]] || : "${LORA_RANK:=64}" "${LORA_ALPHA:=128}"
[[ "${LORA:-0}" != 1 ]] || : "${LEARNING_RATE:=3e-4}"
MODEL_NAME="Qwen-Image"; HF_REPO="Qwen/Qwen-Image"; PREPROCESS="dancegrpo.preprocess.qwenimage"
OUTPUT_DIR_PRESET="${OUTPUT_DIR:-outputs/qwenimage_${PRESET:-}${RUN_SUFFIX}}"   # defaults for PRESET runs
CACHE_DIR_PRESET="${CACHE_DIR:-./cache_dir}"
MODEL_PATH="${MODEL_PATH:-data/qwenimage}"
DATA_JSON="${DATA_JSON:-data/qwenimage_rl_embeddings/videos2caption.json}"
OUTPUT_DIR="${OUTPUT_DIR:-data/outputs/grpo_qwenimage${RUN_SUFFIX}}"
CACHE_DIR="${CACHE_DIR:-data/.cache}"
NPROC_DEFAULT=8
# Upstream's Qwen-Image recipe (docs/gpu_training.md); shared flags: scripts/launch.sh.
MODEL_RECIPE=(
  --vae_model_path "${VAE_MODEL_PATH:-$MODEL_PATH}"
  --selective_checkpointing "${SELECTIVE_CHECKPOINTING:-0.5}"
  --checkpointing_steps "${CHECKPOINTING_STEPS:-60}"
  --sampling_steps "${SAMPLING_STEPS:-20}"
  --sampler_seed "${SAMPLER_SEED:-12627}"
  --max_grad_norm "${MAX_GRAD_NORM:-1.0}"
)
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch.sh"
