# A stand-in for upstream DanceGRPO's fastvideo/train_grpo_flux.py, written from this repository's
# description of upstream (function names, signatures, return values, the inline update loop in
# train_one_step, the argparse parser inline under __main__), built on dancegrpo's SDE step and the
# tiny preset's models so that jagg_patch.upstream can be tested on CPU. Where upstream computes in
# float32, FLOAT is used instead, so that tests can compare in float64.
import torch
import torch.distributed as dist

from dancegrpo.models.base import pack_latents, prepare_latent_image_ids
from dancegrpo.sde import flux_step as _dancegrpo_flux_step
from fastvideo.utils.standin_setup import finish_run, latent_reward, standin_parser, standin_run_objects

FLOAT = torch.float64


def sd3_time_shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


def flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    return _dancegrpo_flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver)


def gather_tensor(tensor):
    parts = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def autocast():
    return torch.autocast("cuda", torch.bfloat16, enabled=torch.cuda.is_available())


def run_sample_step(args, z, progress_bar, sigma_schedule, transformer, encoder_hidden_states, pooled_prompt_embeds,
                    text_ids, image_ids, grpo_sample):
    all_latents = [z]
    all_log_probs = []
    for i in progress_bar:
        timestep_value = int(sigma_schedule[i] * 1000)
        timesteps = torch.full([encoder_hidden_states.shape[0]], timestep_value, device=z.device, dtype=torch.long)
        transformer.eval()
        with autocast():
            pred = transformer(hidden_states=z, encoder_hidden_states=encoder_hidden_states, timestep=timesteps / 1000,
                               guidance=torch.tensor([3.5], device=z.device, dtype=torch.bfloat16),
                               txt_ids=text_ids.repeat(encoder_hidden_states.shape[1], 1),
                               pooled_projections=pooled_prompt_embeds, img_ids=image_ids,
                               joint_attention_kwargs=None, return_dict=False)[0]
        z, pred_original, log_prob = flux_step(pred, z.to(FLOAT), args.eta, sigmas=sigma_schedule, index=i,
                                               prev_sample=None, grpo=True, sde_solver=True)
        all_latents.append(z)
        all_log_probs.append(log_prob)
    return z, pred_original, torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1)


def sample_reference_model(args, device, transformer, vae, encoder_hidden_states, pooled_prompt_embeds, text_ids,
                           reward_model, tokenizer, caption, preprocess_val):
    sigma_schedule = sd3_time_shift(args.shift, torch.linspace(1, 0, args.sampling_steps + 1))
    B = encoder_hidden_states.shape[0]
    latent_h, latent_w = args.h // 8, args.w // 8
    all_latents, all_log_probs, all_rewards, all_image_ids = [], [], [], []
    if args.init_same_noise:
        input_latents = torch.randn((1, 16, latent_h, latent_w), device=device, dtype=FLOAT)
    for index in range(B):
        batch_idx = [index]
        if not args.init_same_noise:
            input_latents = torch.randn((1, 16, latent_h, latent_w), device=device, dtype=FLOAT)
        input_latents_new = pack_latents(input_latents, 1, 16, latent_h, latent_w)
        image_ids = prepare_latent_image_ids(1, latent_h // 2, latent_w // 2, device, FLOAT)
        with torch.no_grad():
            z, latents, batch_latents, batch_log_probs = run_sample_step(
                args, input_latents_new, range(args.sampling_steps), sigma_schedule, transformer,
                encoder_hidden_states[batch_idx], pooled_prompt_embeds[batch_idx], text_ids[batch_idx], image_ids,
                True)
        all_image_ids.append(image_ids)
        all_latents.append(batch_latents)
        all_log_probs.append(batch_log_probs)
        all_rewards.append(reward_model(latents, [caption[i] for i in batch_idx]))
    return (torch.cat(all_rewards), torch.cat(all_latents), torch.cat(all_log_probs), sigma_schedule,
            torch.stack(all_image_ids))


def grpo_one_step(args, latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, text_ids, image_ids,
                  transformer, timesteps, i, sigma_schedule):
    transformer.train()
    with autocast():
        pred = transformer(hidden_states=latents, encoder_hidden_states=encoder_hidden_states,
                           timestep=timesteps / 1000,
                           guidance=torch.tensor([3.5], device=latents.device, dtype=torch.bfloat16),
                           txt_ids=text_ids.repeat(encoder_hidden_states.shape[1], 1),
                           pooled_projections=pooled_prompt_embeds, img_ids=image_ids.squeeze(0),
                           joint_attention_kwargs=None, return_dict=False)[0]
    z, pred_original, log_prob = flux_step(pred, latents.to(FLOAT), args.eta, sigma_schedule, i,
                                           prev_sample=pre_latents.to(FLOAT), grpo=True, sde_solver=True)
    return log_prob


def train_one_step(args, device, transformer, vae, reward_model, tokenizer, optimizer, lr_scheduler, loader,
                   noise_scheduler, max_grad_norm, preprocess_val, ema_handler):
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
    device, transformer, optimizer, lr_scheduler, loader = standin_run_objects("flux", args, FLOAT)
    for step in range(1, args.max_train_steps + 1):
        loss, grad_norm = train_one_step(args, device, transformer, None, latent_reward, None, optimizer, lr_scheduler,
                                         loader, None, args.max_grad_norm, None, None)
        print(f"step {step} loss {loss} grad_norm {grad_norm}")
    finish_run()


if __name__ == "__main__":
    MAIN_BLOCK_RAN = True
    parser = standin_parser()
    args = parser.parse_args()
    main(args)
