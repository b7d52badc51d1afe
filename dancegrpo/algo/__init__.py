"""The algorithm: SDE schedule and kernels, advantages, the GRPO update seam, rollout."""
