# A stand-in for Flow-GRPO's scripts/train_sd3.py, written from this repository's description of it
# (no upstream code): everything in an absl main(_) with an ml_collections config (`--config
# config/grpo.py:<name>`), accelerate for devices, accumulation, clipping and precision; peft LoRA (r 32,
# alpha 64, gaussian init, the attention projections) on pipeline.transformer; ONE accelerator.prepare of
# the model, the optimizer and both dataloaders; a `while True` epoch loop: evaluation with the EMA
# parameters and a checkpoint through accelerator.unwrap_model(...).save_pretrained at its top, the rollout
# through pipeline.transformer (each sample its own noise, [uncond; cond] calls), rewards gathered over the
# processes and advantages per prompt, samples whose advantages are all zero dropped, ONE randperm over the
# samples per inner epoch, the FIRST int(num_steps * timestep_fraction) steps trained in order through the
# prepared model (uncond half detached), the KL term against transformer.module.disable_adapter() under
# no_grad, the PPO loss, accelerator.backward, accelerate's clip on sync steps, optimizer.step() /
# zero_grad() at every call, `info` reduced and logged at each optimizer step, the EMA after each batch.
# What stands for the model folder, the text encoders and the user's Ctrl-C: flow_grpo/standin_setup.py.
# wandb (which cannot log here) is stood for by save_dir/log.jsonl, one line per accelerator.log.
import contextlib
import json
import os
from collections import defaultdict

import numpy as np
import torch
from absl import app, flags
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from ml_collections import config_flags
from peft import LoraConfig, get_peft_model

import flow_grpo.rewards
from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob
from flow_grpo.ema import EMAModuleWrapper
from flow_grpo.standin_setup import compute_text_embeddings, stop_here, tiny_sd3_pipeline
from flow_grpo.stat_tracking import PerPromptStatTracker

FLAGS = flags.FLAGS
if "config" not in FLAGS:   # the stand-in may be loaded twice in one test process; upstream's file once
    config_flags.DEFINE_config_file("config", "config/base.py", "Training configuration.")


class TextPromptDataset(torch.utils.data.Dataset):
    def __init__(self, dataset, split="train"):
        with open(os.path.join(dataset, f"{split}.txt")) as f:
            self.prompts = [line.strip() for line in f if line.strip()]

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, idx):
        return {"prompt": self.prompts[idx], "metadata": {}}

    @staticmethod
    def collate_fn(examples):
        return [e["prompt"] for e in examples], [e["metadata"] for e in examples]


class DistributedKRepeatSampler(torch.utils.data.Sampler):
    """Per iteration, num_replicas * batch_size samples: total / k prompts, each repeated k times, shuffled
    (seed + epoch), this rank's slice of batch_size."""

    def __init__(self, dataset, batch_size, k, num_replicas, rank, seed=0):
        self.dataset, self.batch_size, self.k = dataset, batch_size, k
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.total_samples = num_replicas * batch_size
        assert self.total_samples % k == 0, "k must divide num_replicas * batch_size"
        self.m = self.total_samples // k

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=g)[:self.m].tolist()
            repeated = [idx for idx in indices for _ in range(self.k)]
            order = torch.randperm(len(repeated), generator=g).tolist()
            shuffled = [repeated[i] for i in order]
            yield shuffled[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def set_epoch(self, epoch):
        self.epoch = epoch


def compute_log_prob(transformer, pipeline, sample, j, embeds, pooled_embeds, config):
    if config.train.cfg:
        noise_pred = transformer(hidden_states=torch.cat([sample["latents"][:, j]] * 2),
                                 timestep=torch.cat([sample["timesteps"][:, j]] * 2),
                                 encoder_hidden_states=embeds, pooled_projections=pooled_embeds,
                                 return_dict=False)[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_uncond.detach() + config.sample.guidance_scale * (
            noise_pred_text - noise_pred_uncond.detach())
    else:
        noise_pred = transformer(hidden_states=sample["latents"][:, j], timestep=sample["timesteps"][:, j],
                                 encoder_hidden_states=embeds, pooled_projections=pooled_embeds,
                                 return_dict=False)[0]
    prev_sample, log_prob, prev_sample_mean, std_dev_t = sde_step_with_logprob(
        pipeline.scheduler, noise_pred.float(), sample["timesteps"][:, j], sample["latents"][:, j].float(),
        prev_sample=sample["next_latents"][:, j].float(), noise_level=config.sample.noise_level)
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def log(accelerator, config, data, step):
    accelerator.log(data, step=step)
    if accelerator.is_main_process:   # what wandb would show
        os.makedirs(config.save_dir, exist_ok=True)
        with open(os.path.join(config.save_dir, "log.jsonl"), "a") as f:
            values = {k: float(torch.as_tensor(v).detach()) for k, v in data.items()}
            f.write(json.dumps({"step": step, **values}) + "\n")


def eval(pipeline, test_dataloader, config, accelerator, global_step, reward_fn, neg, ema, parameters):
    if config.train.ema:
        ema.copy_ema_to(parameters, store_temp=True)
    rewards = []
    for prompts, metadata in test_dataloader:
        embeds, pooled = compute_text_embeddings(prompts, pipeline, neg[0].dtype)
        with torch.no_grad():
            images, _, _ = pipeline_with_logprob(
                pipeline, embeds, pooled, neg[0][:len(prompts)], neg[1][:len(prompts)],
                num_inference_steps=config.sample.eval_num_steps, guidance_scale=config.sample.guidance_scale,
                height=config.resolution, width=config.resolution, noise_level=0)
        rewards.append(torch.as_tensor(reward_fn(images, prompts, metadata)[0]["avg"]))
    reward = accelerator.gather(torch.cat(rewards)).mean()
    log(accelerator, config, {"eval_reward": reward}, global_step)
    if config.train.ema:
        ema.copy_temp_to(parameters)


def save_ckpt(save_dir, transformer, global_step, accelerator, ema, parameters, config):
    save_root = os.path.join(save_dir, "checkpoints", f"checkpoint-{global_step}")
    if accelerator.is_main_process:
        if config.train.ema:
            ema.copy_ema_to(parameters, store_temp=True)
        accelerator.unwrap_model(transformer).save_pretrained(os.path.join(save_root, "lora"))
        if config.train.ema:
            ema.copy_temp_to(parameters)


def main(_):
    config = FLAGS.config
    num_train_timesteps = int(config.sample.num_steps * config.train.timestep_fraction)
    accelerator = Accelerator(
        mixed_precision=config.mixed_precision,
        project_config=ProjectConfiguration(project_dir=config.logdir, automatic_checkpoint_naming=True),
        gradient_accumulation_steps=config.train.gradient_accumulation_steps * num_train_timesteps)
    set_seed(config.seed, device_specific=True)

    inference_dtype = getattr(torch, config.pretrained.dtype)
    pipeline = tiny_sd3_pipeline(config.pretrained.model, inference_dtype)
    pipeline.vae.requires_grad_(False)
    pipeline.transformer.requires_grad_(not config.use_lora)
    pipeline.vae.to(accelerator.device)
    pipeline.transformer.to(accelerator.device)
    if config.use_lora:
        target_modules = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                          "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]
        transformer_lora_config = LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian",
                                             target_modules=target_modules)
        pipeline.transformer = get_peft_model(pipeline.transformer, transformer_lora_config)
    transformer = pipeline.transformer
    transformer_trainable_parameters = list(filter(lambda p: p.requires_grad, transformer.parameters()))
    ema = EMAModuleWrapper(transformer_trainable_parameters, decay=0.9, update_step_interval=8,
                           device=accelerator.device)
    optimizer = torch.optim.AdamW(transformer_trainable_parameters, lr=config.train.learning_rate,
                                  betas=(config.train.adam_beta1, config.train.adam_beta2),
                                  weight_decay=config.train.adam_weight_decay, eps=config.train.adam_epsilon)

    reward_fn = flow_grpo.rewards.multi_score(accelerator.device, config.reward_fn)
    train_dataset = TextPromptDataset(config.dataset, "train")
    test_dataset = TextPromptDataset(config.dataset, "test")
    train_sampler = DistributedKRepeatSampler(train_dataset, config.sample.train_batch_size,
                                              config.sample.num_image_per_prompt, accelerator.num_processes,
                                              accelerator.process_index, seed=42)
    train_dataloader = torch.utils.data.DataLoader(train_dataset, batch_sampler=train_sampler,
                                                   collate_fn=TextPromptDataset.collate_fn)
    test_dataloader = torch.utils.data.DataLoader(test_dataset, batch_size=config.sample.test_batch_size,
                                                  collate_fn=TextPromptDataset.collate_fn, shuffle=False)

    neg_prompt_embed, neg_pooled_prompt_embed = compute_text_embeddings([""], pipeline, inference_dtype)
    sample_neg = (neg_prompt_embed.repeat(config.sample.train_batch_size, 1, 1),
                  neg_pooled_prompt_embed.repeat(config.sample.train_batch_size, 1))
    train_neg_prompt_embeds = neg_prompt_embed.repeat(config.train.batch_size, 1, 1)
    train_neg_pooled_prompt_embeds = neg_pooled_prompt_embed.repeat(config.train.batch_size, 1)
    stat_tracker = PerPromptStatTracker(config.sample.global_std) if config.per_prompt_stat_tracking else None
    autocast = contextlib.nullcontext if config.use_lora else accelerator.autocast

    transformer, optimizer, train_dataloader, test_dataloader = accelerator.prepare(
        transformer, optimizer, train_dataloader, test_dataloader)

    samples_per_epoch = config.sample.train_batch_size * accelerator.num_processes * config.sample.num_batches_per_epoch
    accelerator.print(f"samples per epoch {samples_per_epoch}, trained steps {num_train_timesteps}")
    epoch, global_step = 0, 0
    train_iter = iter(train_dataloader)
    while True:
        pipeline.transformer.eval()
        if epoch % config.eval_freq == 0:
            eval(pipeline, test_dataloader, config, accelerator, global_step, reward_fn, sample_neg, ema,
                 transformer_trainable_parameters)
        if epoch % config.save_freq == 0 and epoch > 0:
            save_ckpt(config.save_dir, transformer, global_step, accelerator, ema, transformer_trainable_parameters,
                      config)
        stop_here(epoch, accelerator)

        # ---- sampling
        samples = []
        for i in range(config.sample.num_batches_per_epoch):
            train_sampler.set_epoch(epoch * config.sample.num_batches_per_epoch + i)
            prompts, prompt_metadata = next(train_iter)
            prompt_embeds, pooled_prompt_embeds = compute_text_embeddings(prompts, pipeline, inference_dtype)
            with autocast():
                with torch.no_grad():
                    images, latents, log_probs = pipeline_with_logprob(
                        pipeline, prompt_embeds, pooled_prompt_embeds, sample_neg[0], sample_neg[1],
                        num_inference_steps=config.sample.num_steps, guidance_scale=config.sample.guidance_scale,
                        height=config.resolution, width=config.resolution, noise_level=config.sample.noise_level)
            latents = torch.stack(latents, dim=1)
            log_probs = torch.stack(log_probs, dim=1)
            timesteps = pipeline.scheduler.timesteps.repeat(len(prompts), 1)
            rewards, _ = reward_fn(images, prompts, prompt_metadata)
            samples.append({
                "prompt_ids": torch.as_tensor([train_dataset.prompts.index(p) for p in prompts]),
                "prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled_prompt_embeds,
                "timesteps": timesteps, "latents": latents[:, :-1], "next_latents": latents[:, 1:],
                "log_probs": log_probs, "rewards": torch.as_tensor(rewards["avg"])})
        samples = {k: torch.cat([s[k] for s in samples], dim=0) for k in samples[0]}

        # ---- advantages from the rewards of every process
        gathered_rewards = accelerator.gather(samples["rewards"]).cpu().numpy()
        gathered_ids = accelerator.gather(samples["prompt_ids"]).cpu().numpy()
        log(accelerator, config, {"reward": gathered_rewards.mean(), "epoch": epoch}, global_step)
        if stat_tracker is not None:
            advantages = stat_tracker.update(gathered_ids, gathered_rewards)
        else:
            advantages = (gathered_rewards - gathered_rewards.mean()) / (gathered_rewards.std() + 1e-4)
        advantages = torch.as_tensor(advantages).reshape(accelerator.num_processes, -1, 1)
        samples["advantages"] = advantages[accelerator.process_index].repeat(1, num_train_timesteps)
        del samples["rewards"], samples["prompt_ids"]

        # samples whose advantages are all zero are dropped, topped up to the same multiple of the batch
        # count on every process
        mask = samples["advantages"].abs().sum(dim=1) != 0
        num_batches = config.sample.num_batches_per_epoch
        keep = accelerator.gather(mask.sum().reshape(1)).max().item()
        keep = int(np.ceil(keep / num_batches) * num_batches)
        if keep < len(mask):
            dropped = (~mask).nonzero().flatten()
            mask[dropped[:max(0, keep - int(mask.sum()))]] = True
            samples = {k: v[mask] for k, v in samples.items()}
        total_batch_size, num_timesteps = samples["timesteps"].shape

        # ---- training
        for inner_epoch in range(config.train.num_inner_epochs):
            perm = torch.randperm(total_batch_size, device=accelerator.device)
            samples = {k: v[perm] for k, v in samples.items()}
            samples_batched = {k: v.reshape(-1, total_batch_size // num_batches, *v.shape[1:])
                               for k, v in samples.items()}
            samples_batched = [dict(zip(samples_batched, x)) for x in zip(*samples_batched.values())]
            pipeline.transformer.train()
            info = defaultdict(list)
            for i, sample in enumerate(samples_batched):
                rows = len(sample["prompt_embeds"])
                if config.train.cfg:
                    embeds = torch.cat([train_neg_prompt_embeds[:rows], sample["prompt_embeds"]])
                    pooled_embeds = torch.cat([train_neg_pooled_prompt_embeds[:rows], sample["pooled_prompt_embeds"]])
                else:
                    embeds, pooled_embeds = sample["prompt_embeds"], sample["pooled_prompt_embeds"]
                for j in range(num_train_timesteps):
                    with accelerator.accumulate(transformer):
                        with autocast():
                            prev_sample, log_prob, prev_sample_mean, std_dev_t = compute_log_prob(
                                transformer, pipeline, sample, j, embeds, pooled_embeds, config)
                            if config.train.beta > 0:
                                with torch.no_grad():
                                    with transformer.module.disable_adapter():
                                        _, _, prev_sample_mean_ref, _ = compute_log_prob(
                                            transformer, pipeline, sample, j, embeds, pooled_embeds, config)
                        advantages = torch.clamp(sample["advantages"][:, j], -config.train.adv_clip_max,
                                                 config.train.adv_clip_max)
                        ratio = torch.exp(log_prob - sample["log_probs"][:, j])
                        unclipped_loss = -advantages * ratio
                        clipped_loss = -advantages * torch.clamp(ratio, 1.0 - config.train.clip_range,
                                                                 1.0 + config.train.clip_range)
                        policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
                        if config.train.beta > 0:
                            kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(
                                dim=tuple(range(1, prev_sample_mean.ndim)), keepdim=True) / (2 * std_dev_t ** 2)
                            kl_loss = torch.mean(kl_loss)
                            loss = policy_loss + config.train.beta * kl_loss
                        else:
                            loss = policy_loss
                        info["approx_kl"].append(0.5 * torch.mean((log_prob - sample["log_probs"][:, j]) ** 2))
                        info["clipfrac"].append(torch.mean((torch.abs(ratio - 1.0) > config.train.clip_range).float()))
                        info["clipfrac_gt_one"].append(torch.mean((ratio - 1.0 > config.train.clip_range).float()))
                        info["clipfrac_lt_one"].append(torch.mean((1.0 - ratio > config.train.clip_range).float()))
                        info["policy_loss"].append(policy_loss)
                        if config.train.beta > 0:
                            info["kl_loss"].append(kl_loss)
                        info["loss"].append(loss)
                        accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            accelerator.clip_grad_norm_(transformer.parameters(), config.train.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                    if accelerator.sync_gradients:
                        info = {k: torch.mean(torch.stack(v)) for k, v in info.items()}
                        info = accelerator.reduce(info, reduction="mean")
                        info.update({"epoch": epoch, "inner_epoch": inner_epoch})
                        log(accelerator, config, info, global_step)
                        global_step += 1
                        info = defaultdict(list)
                if config.train.ema:
                    ema.step(transformer_trainable_parameters, global_step)
        epoch += 1


if __name__ == "__main__":
    app.run(main)
