# A stand-in for upstream DanceGRPO's fastvideo/train_grpo_flux_lora.py (see train_grpo_flux.py here):
# the Flux functions, a LoRA adapter on the transformer, and a train_one_step WITHOUT ema_handler,
# token for token the full-weight Flux trainer's before 2145e4f, as upstream's is.
import torch
import torch.distributed as dist

from fastvideo.train_grpo_flux import (FLOAT, flux_step, gather_tensor, grpo_one_step, run_sample_step,  # noqa: F401
                                       sample_reference_model, sd3_time_shift)
from fastvideo.utils.standin_setup import finish_run, latent_reward, standin_parser, standin_run_objects


def train_one_step(args, device, transformer, vae, reward_model, tokenizer, optimizer, lr_scheduler, loader,
                   noise_scheduler, max_grad_norm, preprocess_val):
    total_loss = 0.0
    optimizer.zero_grad()
    encoder_hidden_states, pooled_prompt_embeds, text_ids, caption = next(loader)
    if args.use_group:
        def repeat_tensor(tensor):
            return torch.repeat_interleave(tensor, args.num_generations, dim=0)
        encoder_hidden_states = repeat_tensor(encoder_hidden_states)
        pooled_prompt_embeds = repeat_tensor(pooled_prompt_embeds)
        text_ids = repeat_tensor(text_ids)
        if isinstance(caption, str):
            caption = [caption] * args.num_generations
        elif isinstance(caption, list):
            caption = [item for item in caption for _ in range(args.num_generations)]
        else:
            raise ValueError(f"Unsupported caption type: {type(caption)}")
    reward, all_latents, all_log_probs, sigma_schedule, all_image_ids = sample_reference_model(
        args, device, transformer, vae, encoder_hidden_states, pooled_prompt_embeds, text_ids, reward_model,
        tokenizer, caption, preprocess_val)
    batch_size = all_latents.shape[0]
    timestep_value = [int(sigma * 1000) for sigma in sigma_schedule][:args.sampling_steps]
    timesteps = torch.tensor([timestep_value[:] for _ in range(batch_size)], device=all_latents.device,
                             dtype=torch.long)
    samples = {
        "timesteps": timesteps.detach().clone()[:, :-1],
        "latents": all_latents[:, :-1][:, :-1],
        "next_latents": all_latents[:, 1:][:, :-1],
        "log_probs": all_log_probs[:, :-1],
        "rewards": reward.to(torch.float32),
        "image_ids": all_image_ids,
        "text_ids": text_ids,
        "encoder_hidden_states": encoder_hidden_states,
        "pooled_prompt_embeds": pooled_prompt_embeds,
    }
    gathered_reward = gather_tensor(samples["rewards"])
    if dist.get_rank() == 0:
        print("gathered_hps_reward", gathered_reward)
        with open("./reward.txt", "a") as f:
            f.write(f"{gathered_reward.mean().item()}\n")
    if args.use_group:
        n = len(samples["rewards"]) // args.num_generations
        advantages = torch.zeros_like(samples["rewards"])
        for i in range(n):
            start_idx, end_idx = i * args.num_generations, (i + 1) * args.num_generations
            group_rewards = samples["rewards"][start_idx:end_idx]
            advantages[start_idx:end_idx] = (group_rewards - group_rewards.mean()) / (group_rewards.std() + 1e-8)
        samples["advantages"] = advantages
    else:
        samples["advantages"] = (samples["rewards"] - gathered_reward.mean()) / (gathered_reward.std() + 1e-8)
    perms = torch.stack([torch.randperm(len(samples["timesteps"][0])) for _ in range(batch_size)]).to(device)
    for key in ["timesteps", "latents", "next_latents", "log_probs"]:
        samples[key] = samples[key][torch.arange(batch_size).to(device)[:, None], perms]
    samples_batched = {k: v.unsqueeze(1) for k, v in samples.items()}
    samples_batched_list = [dict(zip(samples_batched, x)) for x in zip(*samples_batched.values())]
    train_timesteps = int(len(samples["timesteps"][0]) * args.timestep_fraction)
    for i, sample in list(enumerate(samples_batched_list)):
        for _ in range(train_timesteps):
            new_log_probs = grpo_one_step(args, sample["latents"][:, _], sample["next_latents"][:, _],
                                          sample["encoder_hidden_states"], sample["pooled_prompt_embeds"],
                                          sample["text_ids"], sample["image_ids"], transformer,
                                          sample["timesteps"][:, _], perms[i][_], sigma_schedule)
            advantages = torch.clamp(sample["advantages"], -args.adv_clip_max, args.adv_clip_max)
            ratio = torch.exp(new_log_probs - sample["log_probs"][:, _])
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * torch.clamp(ratio, 1.0 - args.clip_range, 1.0 + args.clip_range)
            loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss)) / (
                args.gradient_accumulation_steps * train_timesteps)
            loss.backward()
            avg_loss = loss.detach().clone()
            dist.all_reduce(avg_loss)   # upstream: ReduceOp.AVG, which gloo lacks
            total_loss += avg_loss.item() / dist.get_world_size()
        if (i + 1) % args.gradient_accumulation_steps == 0:
            grad_norm = transformer.clip_grad_norm_(max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if dist.get_rank() % 8 == 0:
            print("reward", sample["rewards"].item())
            print("ratio", ratio)
            print("advantage", sample["advantages"].item())
            print("final loss", loss.item())
        dist.barrier()
    return total_loss, grad_norm.item()


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
