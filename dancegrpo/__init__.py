"""A clean re-implementation of DanceGRPO (Flux, Qwen-Image) with one shared core.

Trainer modules (upstream's entry points) are listed in TRAINERS; each exposes
`build_parser`, `main`, `train_one_step` and the update seam `policy_update`.
"""
TRAINERS = ("dancegrpo.train_grpo_flux", "dancegrpo.train_grpo_qwenimage", "dancegrpo.train_grpo_flux_lora")
__version__ = "0.1.0"
