#!/usr/bin/env bash
# DanceGRPO on Qwen-Image: upstream's recipe (scripts/finetune/finetune_qwenimage_grpo.sh) as defaults.
#
#   bash train_qwenimage.sh                      # 8 GPUs, weights in data/qwenimage, embeddings from preprocessing
#   JAGG=1 bash train_qwenimage.sh               # same, with the JAGG patch (python -m jagg_patch ...)
#   PRESET=tiny bash train_qwenimage.sh          # embedded tiny models on CPU, 1 process, no weights needed
#   NPROC=4 OUTPUT_DIR=runs/q bash train_qwenimage.sh --max_train_steps 10   # extra flags pass through
#
# Every value below can be overridden by an environment variable of the same name;
# JAGG=0|1, JAGG_WINDOW, JAGG_FRAC, JAGG_MODE, NPROC, TORCHRUN_ARGS: see scripts/launch.sh.
set -euo pipefail
MODULE="dancegrpo.train_grpo_qwenimage"
MODEL_NAME="Qwen-Image"; HF_REPO="Qwen/Qwen-Image"; PREPROCESS="dancegrpo.preprocess.qwenimage"
OUTPUT_DIR_PRESET="${OUTPUT_DIR:-outputs/qwenimage_${PRESET:-}}"   # defaults for PRESET runs
CACHE_DIR_PRESET="${CACHE_DIR:-./cache_dir}"
MODEL_PATH="${MODEL_PATH:-data/qwenimage}"
DATA_JSON="${DATA_JSON:-data/qwenimage_rl_embeddings/videos2caption.json}"
OUTPUT_DIR="${OUTPUT_DIR:-data/outputs/grpo_qwenimage}"
CACHE_DIR="${CACHE_DIR:-data/.cache}"
NPROC_DEFAULT=8
# Upstream's Qwen-Image recipe (../shared/DANCEGRPO.md, the table); shared flags: scripts/launch.sh.
RECIPE=(
  --vae_model_path "${VAE_MODEL_PATH:-$MODEL_PATH}"
  --selective_checkpointing "${SELECTIVE_CHECKPOINTING:-0.5}"
  --checkpointing_steps "${CHECKPOINTING_STEPS:-60}"
  --sampling_steps "${SAMPLING_STEPS:-20}"
  --sampler_seed "${SAMPLER_SEED:-12627}"
  --max_grad_norm "${MAX_GRAD_NORM:-1.0}"
)
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch.sh"
