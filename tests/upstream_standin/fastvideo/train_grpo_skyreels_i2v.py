# A stand-in for upstream DanceGRPO's fastvideo/train_grpo_skyreels_i2v.py (image to video on fastvideo's
# HunyuanVideo model; see train_grpo_flux.py here), written from this repository's description of it: one
# first frame per call drawn by a Flux pipeline from the first caption, VAE-encoded (a sample), padded in
# time and concatenated after the noisy latents on the channels for every sample; the empty prompt for the
# unconditional half; with --cfg_infer > 1 one call on a doubled [cond, uncond] batch with a guidance of
# two entries, guided in float32 (FLOAT here); one VideoAlign MQ reward returned 3rd of 7 values, the
# last transition dropped, advantages per group or by every rank's rewards, the PPO clip 1e-4 and the
# advantage clamp 5.0 written in the loop, FSDP's clip_grad_norm_.
import torch
import torch.distributed as dist

from dancegrpo.sde import flux_step as _dancegrpo_flux_step
from fastvideo.train_grpo_flux import FLOAT, autocast, sd3_time_shift
from fastvideo.utils.standin_setup import (FirstFramePipe, FirstFrameVAE, VideoAlign, empty_prompt, finish_run,
                                           video_parser, video_run_objects)


def flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    return _dancegrpo_flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver)


def guided_prediction(args, transformer, z, first_frame_latents, timesteps, encoder_hidden_states,
                      encoder_attention_mask, empty_cond_hidden_states, empty_cond_attention_mask):
    if args.cfg_infer > 1:
        latent_model_input = torch.cat([z.repeat(2, 1, 1, 1, 1), first_frame_latents.repeat(2, 1, 1, 1, 1)], dim=1)
        pred = transformer(hidden_states=latent_model_input,
                           encoder_hidden_states=torch.cat((encoder_hidden_states, empty_cond_hidden_states), dim=0),
                           timestep=timesteps.repeat(2),
                           guidance=torch.tensor([1000.0, 1000.0], device=z.device, dtype=torch.bfloat16),
                           encoder_attention_mask=torch.cat((encoder_attention_mask, empty_cond_attention_mask), dim=0),
                           return_dict=False)[0]
        model_pred_cond, model_pred_uncond = pred.chunk(2)
        return model_pred_uncond.to(FLOAT) + args.cfg_infer * (model_pred_cond.to(FLOAT) - model_pred_uncond.to(FLOAT))
    latent_model_input = torch.cat([z, first_frame_latents], dim=1)
    return transformer(hidden_states=latent_model_input, encoder_hidden_states=encoder_hidden_states,
                       timestep=timesteps, guidance=torch.tensor([1000.0], device=z.device, dtype=torch.bfloat16),
                       encoder_attention_mask=encoder_attention_mask, return_dict=False)[0]


def run_sample_step(args, z, first_frame_latents, progress_bar, sigma_schedule, transformer, encoder_hidden_states,
                    encoder_attention_mask, grpo_sample, empty_cond_hidden_states, empty_cond_attention_mask):
    if grpo_sample:
        all_latents = [z]
        all_log_probs = []
        for i in progress_bar:
            sigma = sigma_schedule[i]
            timestep_value = int(sigma * 1000)
            timesteps = torch.full([encoder_hidden_states.shape[0]], timestep_value, device=z.device,
                                   dtype=torch.long)
            transformer.eval()
            with autocast():
                pred = guided_prediction(args, transformer, z, first_frame_latents, timesteps, encoder_hidden_states,
                                         encoder_attention_mask, empty_cond_hidden_states, empty_cond_attention_mask)
            z, pred_original, log_prob = flux_step(pred, z.to(FLOAT), args.eta, sigmas=sigma_schedule, index=i,
                                                   prev_sample=None, grpo=True, sde_solver=True)
            z.to(torch.bfloat16)
            all_latents.append(z)
            all_log_probs.append(log_prob)
        latents = pred_original.to(FLOAT) / 0.476986
        return z, latents, torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1)


def grpo_one_step(args, latents, pre_latents, encoder_hidden_states, encoder_attention_mask, empty_cond_hidden_states,
                  empty_cond_attention_mask, transformer, timesteps, i, sigma_schedule, first_frame_latents):
    transformer.train()
    with autocast():
        pred = guided_prediction(args, transformer, latents, first_frame_latents, timesteps, encoder_hidden_states,
                                 encoder_attention_mask, empty_cond_hidden_states, empty_cond_attention_mask)
    z, pred_original, log_prob = flux_step(pred, latents.to(FLOAT), args.eta, sigma_schedule, i,
                                           prev_sample=pre_latents.to(FLOAT), grpo=True, sde_solver=True)
    return log_prob


def sample_reference_model(args, step, device, transformer, pipe_flux, vae, encoder_hidden_states,
                           encoder_attention_mask, empty_cond_hidden_states, empty_cond_attention_mask, inferencer,
                           caption):
    w, h, t = args.w, args.h, args.t
    sample_steps = args.sampling_steps
    sigma_schedule = sd3_time_shift(args.shift, torch.linspace(1, 0, args.sampling_steps + 1))
    B = encoder_hidden_states.shape[0]
    latent_t = (t - 1) // 4 + 1
    pipe_flux.to(device)
    image = pipe_flux(caption[0], height=h, width=w, guidance_scale=3.5, num_inference_steps=30,
                      max_sequence_length=512)   # upstream: saved to ./videos/flux_{rank}.jpg and reloaded
    pipe_flux.to("cpu")
    first_frame_latents = vae.encode(image.unsqueeze(2).to(FLOAT)).latent_dist.sample() * 0.476986
    padding = torch.zeros((1, 16, latent_t - 1, h // 8, w // 8), device=device, dtype=torch.bfloat16)
    first_frame_latents = torch.cat([first_frame_latents, padding], dim=2)
    batch_indices = torch.chunk(torch.arange(B), B)
    all_latents, all_log_probs, all_rewards = [], [], []
    if args.init_same_noise:
        input_latents = torch.randn((1, 16, latent_t, h // 8, w // 8), device=device, dtype=torch.bfloat16)
    for index, batch_idx in enumerate(batch_indices):
        if not args.init_same_noise:
            input_latents = torch.randn((1, 16, latent_t, h // 8, w // 8), device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            z, latents, batch_latents, batch_log_probs = run_sample_step(
                args, input_latents.clone(), first_frame_latents, range(0, sample_steps), sigma_schedule, transformer,
                encoder_hidden_states[batch_idx], encoder_attention_mask[batch_idx], True, empty_cond_hidden_states,
                empty_cond_attention_mask)
        all_latents.append(batch_latents)
        all_log_probs.append(batch_log_probs)
        videos = latents   # upstream: the VAE decode, written to ./videos/skyreels_{rank}_{index}.mp4
        if args.use_videoalign:
            try:
                reward = inferencer.reward([videos], [caption[index]], use_norm=True)
                reward = torch.tensor(reward[0]["MQ"]).to(device)
            except Exception:
                reward = torch.tensor(-1.0).to(device)
            all_rewards.append(reward.unsqueeze(0))
    all_latents = torch.cat(all_latents, dim=0)
    all_log_probs = torch.cat(all_log_probs, dim=0)
    all_rewards = torch.cat(all_rewards, dim=0)
    return videos, z, all_rewards, all_latents, all_log_probs, sigma_schedule, first_frame_latents


def gather_tensor(tensor):
    if not dist.is_initialized():
        return tensor
    world_size = dist.get_world_size()
    gathered_tensors = [torch.zeros_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered_tensors, tensor)
    return torch.cat(gathered_tensors, dim=0)


def train_one_step(args, device, transformer, pipe_flux, vae, inferencer, optimizer, lr_scheduler, loader,
                   max_grad_norm, step, empty_cond_hidden_states, empty_cond_attention_mask):
    total_loss = 0.0
    optimizer.zero_grad()
    (encoder_hidden_states, encoder_attention_mask, caption) = next(loader)
    if args.use_group:
        def repeat_tensor(tensor):
            if tensor is None:
                return None
            return torch.repeat_interleave(tensor, args.num_generations, dim=0)
        encoder_hidden_states = repeat_tensor(encoder_hidden_states)
        encoder_attention_mask = repeat_tensor(encoder_attention_mask)
        if isinstance(caption, str):
            caption = [caption] * args.num_generations
        elif isinstance(caption, list):
            caption = [item for item in caption for _ in range(args.num_generations)]
        else:
            raise ValueError(f"Unsupported caption type: {type(caption)}")
    empty_cond_hidden_states = empty_cond_hidden_states.unsqueeze(0)
    empty_cond_attention_mask = empty_cond_attention_mask.unsqueeze(0)
    videos, latents, reward, all_latents, all_log_probs, sigma_schedule, first_frame_latents = sample_reference_model(
        args, step, device, transformer, pipe_flux, vae, encoder_hidden_states, encoder_attention_mask,
        empty_cond_hidden_states, empty_cond_attention_mask, inferencer, caption)
    batch_size = all_latents.shape[0]
    timestep_value = [int(sigma * 1000) for sigma in sigma_schedule][:args.sampling_steps]
    timestep_values = [timestep_value[:] for _ in range(batch_size)]
    device = all_latents.device
    timesteps = torch.tensor(timestep_values, device=all_latents.device, dtype=torch.long)
    samples = {
        "timesteps": timesteps.detach().clone()[:, :-1],
        "latents": all_latents[:, :-1][:, :-1],
        "next_latents": all_latents[:, 1:][:, :-1],
        "log_probs": all_log_probs[:, :-1],
        "rewards": reward.to(torch.float32),
        "encoder_hidden_states": encoder_hidden_states,
        "encoder_attention_mask": encoder_attention_mask,
        "empty_cond_hidden_states": empty_cond_hidden_states.repeat(batch_size, 1, 1),
        "empty_cond_attention_mask": empty_cond_attention_mask.repeat(batch_size, 1),
    }
    gathered_reward = gather_tensor(samples["rewards"])
    if dist.get_rank() == 0:
        print("gathered_reward", gathered_reward)
        with open("./reward.txt", "a") as f:
            f.write(f"{gathered_reward.mean().item()}\n")
    if args.use_group:
        n = len(samples["rewards"]) // (args.num_generations)
        advantages = torch.zeros_like(samples["rewards"])
        for i in range(n):
            start_idx = i * args.num_generations
            end_idx = (i + 1) * args.num_generations
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
            clip_range = 1e-4
            adv_clip_max = 5.0
            new_log_probs = grpo_one_step(args, sample["latents"][:, _], sample["next_latents"][:, _],
                                          sample["encoder_hidden_states"], sample["encoder_attention_mask"],
                                          sample["empty_cond_hidden_states"], sample["empty_cond_attention_mask"],
                                          transformer, sample["timesteps"][:, _], perms[i][_], sigma_schedule,
                                          first_frame_latents)
            advantages = torch.clamp(sample["advantages"], -adv_clip_max, adv_clip_max)
            ratio = torch.exp(new_log_probs - sample["log_probs"][:, _])
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
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
    device, transformer, optimizer, lr_scheduler, loader = video_run_objects("skyreels", args, FLOAT)
    empty_cond_hidden_states, empty_cond_attention_mask = empty_prompt(FLOAT)   # ./data/empty/... upstream
    for step in range(1, args.max_train_steps + 1):
        loss, grad_norm = train_one_step(args, device, transformer, FirstFramePipe(), FirstFrameVAE(), VideoAlign(),
                                         optimizer, lr_scheduler, loader, args.max_grad_norm, step,
                                         empty_cond_hidden_states, empty_cond_attention_mask)
        print(f"step {step} loss {loss} grad_norm {grad_norm}")
    finish_run()


if __name__ == "__main__":
    MAIN_BLOCK_RAN = True
    args = video_parser("skyreels").parse_args()
    main(args)
