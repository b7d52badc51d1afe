"""Upstream's import path for its sampler functions; they live in dancegrpo.algo.sde."""
from .algo.sde import flux_step, sd3_time_shift  # noqa: F401
