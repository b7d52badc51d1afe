#!/usr/bin/env bash
# DanceGRPO on Flux: upstream's 8-GPU recipe (scripts/finetune/finetune_flux_grpo.sh) as defaults.
#
#   bash train_flux.sh                           # 8 GPUs, weights in data/flux, embeddings from preprocessing
#   JAGG=1 bash train_flux.sh                    # same flags, policy update through the JAGG patch
#   JAGG=1 JAGG_MODE=endpoints bash train_flux.sh   # the paper's ablation
#   PRESET=tiny bash train_flux.sh               # embedded tiny models on CPU, 1 process, no weights needed
#   NPROC=4 OUTPUT_DIR=runs/f bash train_flux.sh --max_train_steps 10   # extra flags pass through
#
# Every value below can be overridden by an environment variable of the same name;
# JAGG=0|1, JAGG_WINDOW, JAGG_FRAC, JAGG_MODE, NPROC, TORCHRUN_ARGS: see scripts/launch.sh.
set -euo pipefail
MODULE="dancegrpo.train_grpo_flux"
MODEL_NAME="Flux"; HF_REPO="black-forest-labs/FLUX.1-dev"; PREPROCESS="dancegrpo.preprocess.flux"
OUTPUT_DIR_PRESET="${OUTPUT_DIR:-outputs/flux_${PRESET:-}}"   # defaults for PRESET runs
CACHE_DIR_PRESET="${CACHE_DIR:-./cache_dir}"
MODEL_PATH="${MODEL_PATH:-data/flux}"
DATA_JSON="${DATA_JSON:-data/flux_rl_embeddings/videos2caption.json}"
OUTPUT_DIR="${OUTPUT_DIR:-data/outputs/grpo_flux}"
CACHE_DIR="${CACHE_DIR:-data/.cache}"
NPROC_DEFAULT=8
# Upstream's 8-GPU Flux recipe (../shared/DANCEGRPO.md, the table).
RECIPE=(
  --seed "${SEED:-42}"
  --gradient_checkpointing
  --selective_checkpointing "${SELECTIVE_CHECKPOINTING:-1.0}"
  --train_batch_size "${TRAIN_BATCH_SIZE:-2}"
  --num_latent_t 1 --sp_size 1 --train_sp_batch_size 1
  --dataloader_num_workers "${DATALOADER_NUM_WORKERS:-4}"
  --gradient_accumulation_steps "${GRADIENT_ACCUMULATION_STEPS:-12}"
  --max_train_steps "${MAX_TRAIN_STEPS:-300}"
  --learning_rate "${LEARNING_RATE:-1e-5}"
  --mixed_precision bf16
  --checkpointing_steps "${CHECKPOINTING_STEPS:-40}"
  --allow_tf32
  --cfg 0.0
  --h "${HEIGHT:-720}" --w "${WIDTH:-720}" --t 1
  --sampling_steps "${SAMPLING_STEPS:-16}"
  --eta "${ETA:-0.3}"
  --lr_warmup_steps 0
  --max_grad_norm "${MAX_GRAD_NORM:-0.01}"
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
  --use_ema --ema_decay "${EMA_DECAY:-0.995}"
)
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch.sh"
