# A stand-in for upstream DanceGRPO's fastvideo/train_grpo_sd.py (a DDPO-style trainer), written from this
# repository's description of it: everything inline in an absl main(_) with an ml_collections config given by
# --config, accelerate for accumulation, clipping and precision; the rollout through pipeline_with_logprob
# (one initial latent per epoch for every sample, [uncond; cond] calls of pipeline.unet), advantages per
# group of num_generations, per-sample time permutations, the UNet called positionally on [uncond; cond]
# with train.cfg, the DDIM log-prob, the PPO loss, accelerator.backward, accelerate's clip on sync steps and
# optimizer.step() / zero_grad() at every call. The tiny pipeline and the prompts' embeddings stand for
# upstream's model folder and text encoder; the LoRA branch is not modelled (diffusers 0.42's
# LoRAAttnProcessor takes no arguments, so upstream's use_lora fails there).
import contextlib
from collections import defaultdict

import torch
from absl import app, flags
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import DDIMScheduler
from ml_collections import config_flags

from fastvideo.models.stable_diffusion.ddim_with_logprob import ddim_step_with_logprob
from fastvideo.models.stable_diffusion.pipeline_with_logprob import pipeline_with_logprob
from fastvideo.utils.standin_setup import sd_prompt_embeddings, sd_reward, tiny_sd_pipeline

FLAGS = flags.FLAGS
if "config" not in FLAGS:   # the stand-in may be loaded twice in one test process; upstream's file once
    config_flags.DEFINE_config_file("config", "fastvideo/config_sd/base.py", "Training configuration.")


def main(_):
    config = FLAGS.config
    num_train_timesteps = int(config.sample.num_steps * config.train.timestep_fraction)
    accelerator = Accelerator(mixed_precision=config.mixed_precision,
                              gradient_accumulation_steps=config.train.gradient_accumulation_steps * num_train_timesteps)
    set_seed(config.seed, device_specific=True)
    dtype = getattr(torch, config.pretrained.dtype)
    pipeline = tiny_sd_pipeline(dtype, config.pretrained.clip_sample)
    pipeline.vae.requires_grad_(False)
    pipeline.unet.requires_grad_(not config.use_lora)
    pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
    pipeline.to(accelerator.device)
    unet = pipeline.unet
    optimizer = torch.optim.AdamW(unet.parameters(), lr=config.train.learning_rate,
                                  betas=(config.train.adam_beta1, config.train.adam_beta2),
                                  weight_decay=config.train.adam_weight_decay, eps=config.train.adam_epsilon)
    neg_prompt_embed = sd_prompt_embeddings([""], dtype)
    sample_neg_prompt_embeds = neg_prompt_embed.repeat(config.sample.batch_size, 1, 1)
    train_neg_prompt_embeds = neg_prompt_embed.repeat(config.train.batch_size, 1, 1)
    autocast = contextlib.nullcontext if config.use_lora else accelerator.autocast
    unet, optimizer = accelerator.prepare(unet, optimizer)
    for epoch in range(config.num_epochs):
        pipeline.unet.eval()
        prompts = [p for p in config.prompts for _ in range(config.num_generations)]
        init_latents = torch.randn((1, 4, 8, 8), dtype=dtype)   # one latent for every sample of the epoch
        samples = []
        for start in range(0, len(prompts), config.sample.batch_size):
            batch_prompts = prompts[start:start + config.sample.batch_size]
            prompt_embeds = sd_prompt_embeddings(batch_prompts, dtype)
            with autocast():
                images, _, latents, log_probs = pipeline_with_logprob(
                    pipeline, prompt_embeds=prompt_embeds, negative_prompt_embeds=sample_neg_prompt_embeds,
                    num_inference_steps=config.sample.num_steps, guidance_scale=config.sample.guidance_scale,
                    eta=config.sample.eta, output_type="pt", latents=init_latents.repeat(len(batch_prompts), 1, 1, 1))
            latents = torch.stack(latents, dim=1)
            log_probs = torch.stack(log_probs, dim=1)
            timesteps = pipeline.scheduler.timesteps.repeat(len(batch_prompts), 1)
            samples.append({"prompt_embeds": prompt_embeds, "timesteps": timesteps[:, :-1],
                            "latents": latents[:, :-1][:, :-1], "next_latents": latents[:, 1:][:, :-1],
                            "log_probs": log_probs[:, :-1],
                            "rewards": sd_reward(images, batch_prompts).to(torch.float32)})
        samples = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
        gathered_rewards = accelerator.gather(samples["rewards"])
        if accelerator.is_main_process:
            with open("./reward.txt", "a") as f:
                f.write(f"{gathered_rewards.mean().item()}\n")
        rewards = samples["rewards"]
        advantages = torch.zeros_like(rewards)
        for g in range(0, len(rewards), config.num_generations):
            group = rewards[g:g + config.num_generations]
            advantages[g:g + config.num_generations] = (group - group.mean()) / (group.std() + 1e-8)
        samples["advantages"] = advantages
        total_batch_size, num_timesteps = samples["timesteps"].shape
        for inner_epoch in range(config.train.num_inner_epochs):
            perms = torch.stack([torch.randperm(num_timesteps) for _ in range(total_batch_size)])
            for key in ["timesteps", "latents", "next_latents", "log_probs"]:
                samples[key] = samples[key][torch.arange(total_batch_size)[:, None], perms]
            samples_batched = {k: v.reshape(-1, config.train.batch_size, *v.shape[1:]) for k, v in samples.items()}
            samples_batched = [dict(zip(samples_batched, x)) for x in zip(*samples_batched.values())]
            pipeline.unet.train()
            info = defaultdict(list)
            for i, sample in enumerate(samples_batched):
                if config.train.cfg:
                    embeds = torch.cat([train_neg_prompt_embeds, sample["prompt_embeds"]])
                else:
                    embeds = sample["prompt_embeds"]
                for j in range(num_train_timesteps):
                    with accelerator.accumulate(unet):
                        with autocast():
                            if config.train.cfg:
                                noise_pred = unet(torch.cat([sample["latents"][:, j]] * 2),
                                                  torch.cat([sample["timesteps"][:, j]] * 2), embeds).sample
                                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                                noise_pred = noise_pred_uncond + config.sample.guidance_scale * (
                                    noise_pred_text - noise_pred_uncond)
                            else:
                                noise_pred = unet(sample["latents"][:, j], sample["timesteps"][:, j], embeds).sample
                            _, log_prob = ddim_step_with_logprob(pipeline.scheduler, noise_pred, sample["timesteps"][:, j],
                                                                 sample["latents"][:, j], eta=config.sample.eta,
                                                                 prev_sample=sample["next_latents"][:, j])
                        advantages = torch.clamp(sample["advantages"], -config.train.adv_clip_max,
                                                 config.train.adv_clip_max)
                        ratio = torch.exp(log_prob - sample["log_probs"][:, j])
                        unclipped_loss = -advantages * ratio
                        clipped_loss = -advantages * torch.clamp(ratio, 1.0 - config.train.clip_range,
                                                                 1.0 + config.train.clip_range)
                        loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
                        info["approx_kl"].append(0.5 * torch.mean((log_prob - sample["log_probs"][:, j]) ** 2))
                        info["clipfrac"].append(torch.mean((torch.abs(ratio - 1.0) > config.train.clip_range).float()))
                        accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            accelerator.clip_grad_norm_(unet.parameters(), config.train.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                    if accelerator.sync_gradients:
                        assert (j == num_train_timesteps - 1) and (i + 1) % config.train.gradient_accumulation_steps == 0
            print(f"epoch {epoch} approx_kl {torch.stack(info['approx_kl']).mean().item()} "
                  f"clipfrac {torch.stack(info['clipfrac']).mean().item()}", flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    MAIN_BLOCK_RAN = True
    app.run(main)
