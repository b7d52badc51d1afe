# A stand-in for upstream DanceGRPO's fastvideo/models/stable_diffusion/pipeline_with_logprob.py (DDPO's
# sampler): the prompt and negative embeddings concatenated by the pipeline's _encode_prompt (on diffusers
# 0.42 always, so it cannot sample without guidance), the UNet called by keyword on the doubled batch
# [uncond; cond] with a 0-d timestep and return_dict=False, the guidance combination, the DDIM step with
# its log-prob; returns the decoded images, None, the latents of every step and the log-probs.
import torch

from .ddim_with_logprob import ddim_step_with_logprob


@torch.no_grad()
def pipeline_with_logprob(self, prompt=None, height=None, width=None, num_inference_steps=50, guidance_scale=7.5,
                          negative_prompt=None, num_images_per_prompt=1, eta=0.0, generator=None, latents=None,
                          prompt_embeds=None, negative_prompt_embeds=None, output_type="pt",
                          cross_attention_kwargs=None):
    device = latents.device
    do_classifier_free_guidance = guidance_scale > 1.0
    prompt_embeds = self._encode_prompt(prompt, device, num_images_per_prompt, do_classifier_free_guidance,
                                        negative_prompt, prompt_embeds=prompt_embeds,
                                        negative_prompt_embeds=negative_prompt_embeds)
    self.scheduler.set_timesteps(num_inference_steps, device=device)
    timesteps = self.scheduler.timesteps
    all_latents = [latents]
    all_log_probs = []
    for i, t in enumerate(timesteps):
        latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance else latents
        latent_model_input = self.scheduler.scale_model_input(latent_model_input, t)
        noise_pred = self.unet(latent_model_input, t, encoder_hidden_states=prompt_embeds,
                               cross_attention_kwargs=cross_attention_kwargs, return_dict=False)[0]
        if do_classifier_free_guidance:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        latents, log_prob = ddim_step_with_logprob(self.scheduler, noise_pred, t, latents, eta=eta,
                                                   generator=generator)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    image = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]
    return image, None, all_latents, all_log_probs
