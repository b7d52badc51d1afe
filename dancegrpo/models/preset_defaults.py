"""What the families' presets share (dancegrpo/models/<family>/presets.py): the flag defaults of the
tiny, small and digits presets, where the digits world is shipped, and the seeded stand-in for a
text encoder's output."""
import os


def seeded_randn(shape, seed):
    """A fixed random tensor (a preset's stand-in for a text encoder's output)."""
    import torch   # here: the flag defaults above are read by the command line before torch loads
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# Defaults shared by the tiny presets: the recipe measured to learn on 2 CPU cores
# on these CPUs: 8 prompts x 16 generations, ONE optimizer step per training step.
TINY_DEFAULTS = dict(h=64, w=64, sampling_steps=8, shift=3.0, eta=0.3, train_batch_size=8,
                     num_generations=16, use_group=True, init_same_noise=True, timestep_fraction=0.6,
                     learning_rate=1e-2, weight_decay=1e-4, max_grad_norm=1.0, gradient_accumulation_steps=128,
                     lr_warmup_steps=0, lr_scheduler="constant", max_train_steps=30, checkpointing_steps=1000,
                     reward="jpeg", seed=42, clip_range=1e-4, adv_clip_max=5.0, sample_batch_size=128,
                     update_batch_size=32, dataloader_num_workers=0)
# CPU benchmark geometry: ~20M parameters, 256 image tokens, upstream's S and fraction.
SMALL_DEFAULTS = dict(h=256, w=256, sampling_steps=16, shift=3.0, eta=0.3, train_batch_size=1,
                      num_generations=4, use_group=True, init_same_noise=True, timestep_fraction=0.6,
                      learning_rate=1e-5, weight_decay=1e-4, max_grad_norm=1.0, gradient_accumulation_steps=4,
                      lr_warmup_steps=0, lr_scheduler="constant", max_train_steps=3, checkpointing_steps=1000,
                      reward="jpeg", seed=42, clip_range=1e-4, adv_clip_max=5.0, sample_batch_size=4,
                      update_batch_size=1, dataloader_num_workers=0)

# The digits world (dancegrpo.digits): models trained by `python -m dancegrpo.digits.build`, shipped
# in dancegrpo/assets/digits/<family>/ with their prompt data; nothing is built at run time.
# lr 1e-4 measured on Flux: 40 steps take the held-out correct-class rate from 61% to 83% (1e-3 wrecks
# the trained model: 43%; 2e-5 is slow: 65%; the shuffled control ends at 55%). The same defaults
# serve Qwen-Image: 60 steps, 70.5% -> 92.5% (seed 42, 200 evaluation samples).
DIGITS_DEFAULTS = dict(TINY_DEFAULTS, learning_rate=1e-4, max_train_steps=60, reward="digit", sample_every=20)
DIGITS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "digits")

# The digits_large world (the same build, --world digits_large): deeper transformers whose parameter
# Jacobian is the least linear along the trajectory found at this scale. It trains at upstream's
# trajectory geometry (S 16 Flux, S 20 Qwen-Image, fraction 0.6: 9 / 11 trained transitions), where its
# fidelity profile is measured, so that W 4 and W 8 group the same transitions in training as there.
DIGITS_LARGE_DEFAULTS = dict(DIGITS_DEFAULTS, sampling_steps=16)
DIGITS_LARGE_DIR = os.path.join(os.path.dirname(DIGITS_DIR), "digits_large")
