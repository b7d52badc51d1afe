# A stand-in for upstream DanceGRPO's fastvideo/train_grpo_flux_lora.py (see train_grpo_flux.py here):
# the Flux functions, a LoRA adapter on the transformer, and a train_one_step WITHOUT ema_handler.
import torch

from fastvideo.train_grpo_flux import (FLOAT, flux_step, gather_tensor, grpo_one_step, run_sample_step,  # noqa: F401
                                       sample_reference_model, sd3_time_shift)
from fastvideo import train_grpo_flux as _flux
from fastvideo.utils.standin_setup import finish_run, latent_reward, standin_parser, standin_run_objects


def train_one_step(args, device, transformer, vae, reward_model, tokenizer, optimizer, lr_scheduler, loader,
                   noise_scheduler, max_grad_norm, preprocess_val):
    # Upstream repeats the Flux loop inline; the stand-in runs the Flux stand-in's.
    return _flux.train_one_step(args, device, transformer, vae, reward_model, tokenizer, optimizer, lr_scheduler,
                                loader, noise_scheduler, max_grad_norm, preprocess_val, None)


def main(args):
    device, transformer, optimizer, lr_scheduler, loader = standin_run_objects("flux", args, FLOAT, lora=True)
    for step in range(1, args.max_train_steps + 1):
        loss, grad_norm = train_one_step(args, device, transformer, None, latent_reward, None, optimizer, lr_scheduler,
                                         loader, None, args.max_grad_norm, None)
        print(f"step {step} loss {loss} grad_norm {grad_norm}")
    finish_run()


if __name__ == "__main__":
    MAIN_BLOCK_RAN = True
    args = standin_parser().parse_args()
    main(args)
