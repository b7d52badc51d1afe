# A stand-in for Flow-GRPO's flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py, written from this
# repository's description of it: each sample its own initial noise, the scheduler's timesteps
# (t = sigma * 1000), pipeline.transformer called by keyword (hidden_states, timestep,
# encoder_hidden_states, pooled_projections, joint_attention_kwargs=None, return_dict=False) on the
# doubled batch [uncond; cond] when guidance > 1, the output cast to the prompt embeddings' dtype and
# combined, then sde_step_with_logprob on float32; returns the decoded images, the latents of every
# step and the log-probs.
import torch
from diffusers.utils.torch_utils import randn_tensor

from .sd3_sde_with_logprob import sde_step_with_logprob


@torch.no_grad()
def pipeline_with_logprob(self, prompt_embeds, pooled_prompt_embeds, negative_prompt_embeds,
                          negative_pooled_prompt_embeds, num_inference_steps=10, guidance_scale=4.5, height=None,
                          width=None, output_type="pt", noise_level=0.7, generator=None):
    do_classifier_free_guidance = guidance_scale > 1.0
    if do_classifier_free_guidance:
        prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds], dim=0)
        pooled_prompt_embeds = torch.cat([negative_pooled_prompt_embeds, pooled_prompt_embeds], dim=0)
    batch_size = pooled_prompt_embeds.shape[0] // (2 if do_classifier_free_guidance else 1)
    channels = self.transformer.config.in_channels
    shape = (batch_size, channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
    latents = randn_tensor(shape, generator=generator, device=prompt_embeds.device, dtype=prompt_embeds.dtype)
    self.scheduler.set_timesteps(num_inference_steps, device=prompt_embeds.device)
    all_latents = [latents]
    all_log_probs = []
    for t in self.scheduler.timesteps:
        latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance else latents
        timestep = t.expand(latent_model_input.shape[0])
        noise_pred = self.transformer(hidden_states=latent_model_input, timestep=timestep,
                                      encoder_hidden_states=prompt_embeds, pooled_projections=pooled_prompt_embeds,
                                      joint_attention_kwargs=None, return_dict=False)[0]
        noise_pred = noise_pred.to(prompt_embeds.dtype)
        if do_classifier_free_guidance:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        latents, log_prob, _, _ = sde_step_with_logprob(self.scheduler, noise_pred.float(), t.unsqueeze(0),
                                                        latents.float(), noise_level=noise_level, generator=generator)
        # the model's dtype for the next call (autocast casts the float32 latents on a GPU; the cast from
        # float32 is exact, so the stored latents hold the values the log-probs were computed at)
        latents = latents.to(prompt_embeds.dtype)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
    image = self.vae.decode(latents, return_dict=False)[0]
    return image, all_latents, all_log_probs
