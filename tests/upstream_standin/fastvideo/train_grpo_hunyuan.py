# A stand-in for upstream DanceGRPO's fastvideo/train_grpo_hunyuan.py (text to video on fastvideo's
# HunyuanVideo model; see train_grpo_flux.py here), written from this repository's description of it:
# the rollout one sample at a time with a bf16 noise (shared with --use_same_noise), integer timesteps
# and a bf16 guidance of 6018 (6016) to the model, two VideoAlign rewards (VQ, MQ; both -1.0 when the
# reward fails) returned 3rd and 4th of 7 values, the last transition dropped, per-group advantages
# on the rank's rewards for each, best-of-n over the rank's batch with a shuffle always drawn, one loss
# vq_coef * L_vq + mq_coef * L_mq with the PPO clip 1e-4 and the advantage clamp 5.0 written in the
# loop, FSDP's clip_grad_norm_, and grad_norm of the last optimizer step returned.
import torch
import torch.distributed as dist

from dancegrpo.sde import flux_step as _dancegrpo_flux_step
from fastvideo.train_grpo_flux import FLOAT, autocast, sd3_time_shift
from fastvideo.utils.standin_setup import VideoAlign, finish_run, video_parser, video_run_objects


def flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    return _dancegrpo_flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver)


def run_sample_step(args, z, progress_bar, sigma_schedule, transformer, encoder_hidden_states, encoder_attention_mask,
                    grpo_sample):
    if grpo_sample:
        all_latents = [z]
        all_log_probs = []
        for i in progress_bar:
            B = encoder_hidden_states.shape[0]
            sigma = sigma_schedule[i]
            timestep_value = int(sigma * 1000)
            timesteps = torch.full([encoder_hidden_states.shape[0]], timestep_value, device=z.device,
                                   dtype=torch.long)
            transformer.eval()
            with autocast():
                pred = transformer(hidden_states=z, encoder_hidden_states=encoder_hidden_states, timestep=timesteps,
                                   guidance=torch.tensor([6018.0], device=z.device, dtype=torch.bfloat16),
                                   encoder_attention_mask=encoder_attention_mask, return_dict=False)[0]
            z, pred_original, log_prob = flux_step(pred, z.to(FLOAT), args.eta, sigmas=sigma_schedule, index=i,
                                                   prev_sample=None, grpo=True, sde_solver=True)
            z.to(torch.bfloat16)
            all_latents.append(z)
            all_log_probs.append(log_prob)
        latents = pred_original.to(FLOAT) / 0.476986
        all_latents = torch.stack(all_latents, dim=1)
        all_log_probs = torch.stack(all_log_probs, dim=1)
        return z, latents, all_latents, all_log_probs


def grpo_one_step(args, latents, pre_latents, encoder_hidden_states, encoder_attention_mask, transformer, timesteps, i,
                  sigma_schedule):
    B = encoder_hidden_states.shape[0]
    transformer.train()
    with autocast():
        pred = transformer(hidden_states=latents, encoder_hidden_states=encoder_hidden_states, timestep=timesteps,
                           guidance=torch.tensor([6018.0], device=latents.device, dtype=torch.bfloat16),
                           encoder_attention_mask=encoder_attention_mask, return_dict=False)[0]
    z, pred_original, log_prob = flux_step(pred, latents.to(FLOAT), args.eta, sigma_schedule, i,
                                           prev_sample=pre_latents.to(FLOAT), grpo=True, sde_solver=True)
    return log_prob


def sample_reference_model(args, step, device, transformer, vae, encoder_hidden_states, encoder_attention_mask,
                           inferencer, caption):
    w, h, t = args.w, args.h, args.t
    sample_steps = args.sampling_steps
    sigma_schedule = sd3_time_shift(args.shift, torch.linspace(1, 0, args.sampling_steps + 1))
    B = encoder_hidden_states.shape[0]
    latent_t = (t - 1) // 4 + 1
    batch_indices = torch.chunk(torch.arange(B), B)
    all_latents, all_log_probs, all_vq_rewards, all_mq_rewards = [], [], [], []
    if args.use_same_noise:
        input_latents = torch.randn((1, 16, latent_t, h // 8, w // 8), device=device, dtype=torch.bfloat16)
    for index, batch_idx in enumerate(batch_indices):
        batch_encoder_hidden_states = encoder_hidden_states[batch_idx]
        batch_encoder_attention_mask = encoder_attention_mask[batch_idx]
        generator = torch.Generator(device=device).manual_seed(42)
        if not args.use_same_noise:
            input_latents = torch.randn((1, 16, latent_t, h // 8, w // 8), device=device, dtype=torch.bfloat16)
        grpo_sample = True
        progress_bar = range(0, sample_steps)
        with torch.no_grad():
            z, latents, batch_latents, batch_log_probs = run_sample_step(
                args, input_latents.clone(), progress_bar, sigma_schedule, transformer, batch_encoder_hidden_states,
                batch_encoder_attention_mask, grpo_sample)
        all_latents.append(batch_latents)
        all_log_probs.append(batch_log_probs)
        videos = latents   # upstream: the VAE decode, written to ./videos/hunyuan_{RANK}_{index}.mp4
        if args.use_videoalign:
            try:
                reward = inferencer.reward([videos], [caption[index]], use_norm=True)
                vq_reward = torch.tensor(reward[0]["VQ"]).to(device)
                mq_reward = torch.tensor(reward[0]["MQ"]).to(device)
            except Exception:
                vq_reward = torch.tensor(-1.0).to(device)
                mq_reward = torch.tensor(-1.0).to(device)
            all_vq_rewards.append(vq_reward.unsqueeze(0))
            all_mq_rewards.append(mq_reward.unsqueeze(0))
    all_latents = torch.cat(all_latents, dim=0)
    all_log_probs = torch.cat(all_log_probs, dim=0)
    all_vq_rewards = torch.cat(all_vq_rewards, dim=0)
    all_mq_rewards = torch.cat(all_mq_rewards, dim=0)
    return videos, z, all_vq_rewards, all_mq_rewards, all_latents, all_log_probs, sigma_schedule


def gather_tensor(tensor):
    if not dist.is_initialized():
        return tensor
    world_size = dist.get_world_size()
    gathered_tensors = [torch.zeros_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered_tensors, tensor)
    return torch.cat(gathered_tensors, dim=0)


def train_one_step(args, device, transformer, vae, inferencer, optimizer, lr_scheduler, loader, max_grad_norm, step):
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
    videos, latents, vq_reward, mq_reward, all_latents, all_log_probs, sigma_schedule = sample_reference_model(
        args, step, device, transformer, vae, encoder_hidden_states, encoder_attention_mask, inferencer, caption)
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
        "vq_rewards": vq_reward.to(torch.float32),
        "mq_rewards": mq_reward.to(torch.float32),
        "encoder_hidden_states": encoder_hidden_states,
        "encoder_attention_mask": encoder_attention_mask,
    }
    # every rank gathers (an all_gather on rank 0 alone would wait for the others); rank 0 reports
    gathered_vq_reward = gather_tensor(samples["vq_rewards"])
    gathered_mq_reward = gather_tensor(samples["mq_rewards"])
    if dist.get_rank() == 0:
        print("gathered_vq_reward", gathered_vq_reward)
        with open("./vq_reward.txt", "a") as f:
            f.write(f"{gathered_vq_reward.mean().item()}\n")
        print("gathered_mq_reward", gathered_mq_reward)
        with open("./mq_reward.txt", "a") as f:
            f.write(f"{gathered_mq_reward.mean().item()}\n")
    n = len(samples["vq_rewards"]) // (args.num_generations)
    vq_advantages = torch.zeros_like(samples["vq_rewards"])
    for i in range(n):
        start_idx = i * args.num_generations
        end_idx = (i + 1) * args.num_generations
        group_rewards = samples["vq_rewards"][start_idx:end_idx]
        vq_advantages[start_idx:end_idx] = (group_rewards - group_rewards.mean()) / (group_rewards.std() + 1e-8)
    samples["vq_advantages"] = vq_advantages
    mq_advantages = torch.zeros_like(samples["mq_rewards"])
    for i in range(n):
        start_idx = i * args.num_generations
        end_idx = (i + 1) * args.num_generations
        group_rewards = samples["mq_rewards"][start_idx:end_idx]
        mq_advantages[start_idx:end_idx] = (group_rewards - group_rewards.mean()) / (group_rewards.std() + 1e-8)
    samples["mq_advantages"] = mq_advantages
    total_advantages = args.vq_coef * samples["vq_advantages"] + args.mq_coef * samples["mq_advantages"]
    sorted_indices = torch.argsort(total_advantages)
    top_indices = sorted_indices[-args.bestofn // 2:]
    bottom_indices = sorted_indices[:args.bestofn // 2]
    selected_indices = torch.cat([top_indices, bottom_indices])
    shuffled_indices = selected_indices[torch.randperm(len(selected_indices))]
    if args.num_generations != args.bestofn:
        for key in samples:
            samples[key] = samples[key][shuffled_indices]
        batch_size = args.bestofn
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
                                          transformer, sample["timesteps"][:, _], perms[i][_], sigma_schedule)
            ratio = torch.exp(new_log_probs - sample["log_probs"][:, _])
            vq_advantages = torch.clamp(sample["vq_advantages"], -adv_clip_max, adv_clip_max)
            vq_unclipped_loss = -vq_advantages * ratio
            vq_clipped_loss = -vq_advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
            vq_loss = torch.mean(torch.max(vq_unclipped_loss, vq_clipped_loss)) / (
                args.gradient_accumulation_steps * train_timesteps)
            mq_advantages = torch.clamp(sample["mq_advantages"], -adv_clip_max, adv_clip_max)
            mq_unclipped_loss = -mq_advantages * ratio
            mq_clipped_loss = -mq_advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
            mq_loss = torch.mean(torch.max(mq_unclipped_loss, mq_clipped_loss)) / (
                args.gradient_accumulation_steps * train_timesteps)
            final_loss = args.vq_coef * vq_loss + args.mq_coef * mq_loss
            final_loss.backward()
            avg_loss = final_loss.detach().clone()
            dist.all_reduce(avg_loss)   # upstream: ReduceOp.AVG, which gloo lacks
            total_loss += avg_loss.item() / dist.get_world_size()
        if (i + 1) % args.gradient_accumulation_steps == 0:
            grad_norm = transformer.clip_grad_norm_(max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if dist.get_rank() % 8 == 0:
            print("vq loss/mq loss", vq_loss.item(), mq_loss.item())
            print("vq/mq reward", sample["vq_rewards"].item(), sample["mq_rewards"].item())
            print(" ratio", ratio)
            print("vq advantage/mq advantage", vq_advantages.item(), mq_advantages.item())
            print("final loss", final_loss.item())
        dist.barrier()
    return total_loss, grad_norm.item()


def main(args):
    device, transformer, optimizer, lr_scheduler, loader = video_run_objects("hunyuan", args, FLOAT)
    inferencer = VideoAlign()
    for step in range(1, args.max_train_steps + 1):
        loss, grad_norm = train_one_step(args, device, transformer, None, inferencer, optimizer, lr_scheduler, loader,
                                         args.max_grad_norm, step)
        print(f"step {step} loss {loss} grad_norm {grad_norm}")
    finish_run()


if __name__ == "__main__":
    MAIN_BLOCK_RAN = True
    args = video_parser("hunyuan").parse_args()
    main(args)
