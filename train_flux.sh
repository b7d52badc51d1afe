#!/usr/bin/env bash
# DanceGRPO on Flux: upstream's recipes (scripts/finetune/finetune_flux_grpo_8gpus.sh and the
# 2x8-GPU finetune_flux_grpo.sh) as defaults.
#
#   bash train_flux.sh                           # 8 GPUs, weights in data/flux, embeddings from preprocessing
#   RECIPE=16gpu NODE_RANK=0 MASTER_ADDR=node0 bash train_flux.sh   # upstream's 2x8-GPU recipe, on each node
#   JAGG=1 bash train_flux.sh                    # same flags, policy update through the JAGG patch
#   JAGG=1 JAGG_MODE=endpoints bash train_flux.sh   # the paper's ablation
#   ALGO=flow_grpo_fast bash train_flux.sh       # Flow-GRPO-Fast's recipe (window 3 of 6 steps, cps 0.8)
#   LORA=1 bash train_flux.sh                    # upstream's LoRA recipe (train_grpo_flux_lora.py): r 128,
#                                                # alpha 256, lr 3e-4, S 12, batch 2, GA 12, no EMA
#   PRESET=tiny bash train_flux.sh               # embedded tiny models on CPU, 1 process, no weights needed
#   NPROC=4 OUTPUT_DIR=runs/f bash train_flux.sh --max_train_steps 10   # extra flags pass through
#
# Every value below can be overridden by an environment variable of the same name;
# JAGG=0|1, JAGG_WINDOW, JAGG_FRAC, JAGG_MODE, JAGG_BACKWARD, JAGG_REUSE_ROLLOUT, LORA=0|1, LORA_RANK, LORA_ALPHA,
# LORA_TARGET_MODULES,
# NPROC, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, TORCHRUN_ARGS: see scripts/launch.sh.
set -euo pipefail
MODULE="dancegrpo.train_grpo_flux"
# ALGO=flow_grpo_fast: Flow-GRPO-Fast's FLUX config: 6 steps, a window of
# 3 drawn in (0, 3), the cps kernel at 0.8, clip 1e-5, Flow-GRPO's advantage; LoRA r 64 / alpha 128.
FAST_RECIPE=(--sampling_steps "${SAMPLING_STEPS:-6}" --sde_window_size "${SDE_WINDOW_SIZE:-3}"
             --sde_window_range 0 3 --sde_type cps --eta "${ETA:-0.8}" --clip_range "${CLIP_RANGE:-1e-5}"
             --advantage flow_grpo)
[[ "${ALGO:-}" != flow_grpo_fast ]] || : "${LORA_RANK:=64}" "${LORA_ALPHA:=128}"
if [[ "${LORA:-0}" == 1 ]]; then   # upstream's scripts/finetune LoRA recipe
  MODULE="dancegrpo.train_grpo_flux_lora"
  : "${LEARNING_RATE:=3e-4}" "${SAMPLING_STEPS:=12}" "${TRAIN_BATCH_SIZE:=2}" "${GRADIENT_ACCUMULATION_STEPS:=12}"
  NO_EMA=1   # upstream's LoRA trainer keeps no EMA
fi
MODEL_NAME="Flux"; HF_REPO="black-forest-labs/FLUX.1-dev"; PREPROCESS="dancegrpo.preprocess.flux"
OUTPUT_DIR_PRESET="${OUTPUT_DIR:-outputs/flux_${PRESET:-}}"   # defaults for PRESET runs
CACHE_DIR_PRESET="${CACHE_DIR:-./cache_dir}"
MODEL_PATH="${MODEL_PATH:-data/flux}"
DATA_JSON="${DATA_JSON:-data/flux_rl_embeddings/videos2caption.json}"
OUTPUT_DIR="${OUTPUT_DIR:-data/outputs/grpo_flux}"
CACHE_DIR="${CACHE_DIR:-data/.cache}"
NPROC_DEFAULT=8
# RECIPE: 8gpu (default, upstream's finetune_flux_grpo_8gpus.sh) or 16gpu (upstream's 2x8-GPU
# finetune_flux_grpo.sh, which its README recommends "for better convergence"); the table in
# docs/gpu_training.md. Environment variables still win.
case "${RECIPE:-8gpu}" in
  8gpu)
    EMA_FLAGS=(--use_ema --ema_decay "${EMA_DECAY:-0.995}")
    [[ -z "${NO_EMA:-}" ]] || EMA_FLAGS=()
    : "${MAX_GRAD_NORM:=0.01}" "${TRAIN_SP_BATCH_SIZE:=2}" ;;
  16gpu)
    EMA_FLAGS=()
    [[ -n "${PRESET:-}" ]] || : "${NNODES:=2}"   # two nodes of 8 GPUs (a PRESET run stays on one machine)
    : "${TRAIN_BATCH_SIZE:=1}" "${GRADIENT_ACCUMULATION_STEPS:=4}" "${MAX_GRAD_NORM:=1.0}" ;;
  *) echo "error: RECIPE must be 8gpu or 16gpu, got '${RECIPE}'" >&2; exit 2 ;;
esac
MODEL_RECIPE=(
  --selective_checkpointing "${SELECTIVE_CHECKPOINTING:-1.0}"
  --checkpointing_steps "${CHECKPOINTING_STEPS:-40}"
  --sampling_steps "${SAMPLING_STEPS:-16}"
  --sampler_seed "${SAMPLER_SEED:-1223627}"
  --max_grad_norm "${MAX_GRAD_NORM}"
  "${EMA_FLAGS[@]}"
)
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch.sh"
