import math

import numpy as np
import pytest
import torch

from dancegrpo.algo.sde import flux_step, model_timesteps, sd3_time_shift, sigma_schedule


def test_sd3_time_shift_values():
    t = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    assert torch.allclose(sd3_time_shift(3.0, t), torch.tensor([0.0, 0.75, 1.0], dtype=torch.float64))
    assert torch.equal(sd3_time_shift(1.0, t), t)


def _upstream_timestep_ints(sampling_steps, shift):
    """Upstream's rule written with numpy float32 scalars: the sigma grid in float32, then
    int(sigma * 1000) with the product rounded to float32 (a 0-dim float32 tensor times 1000)."""
    t = np.linspace(1, 0, sampling_steps + 1).astype(np.float32)
    s = np.float32(shift)
    sig = (s * t) / (np.float32(1) + (s - np.float32(1)) * t)
    return [int(np.float32(x) * np.float32(1000)) for x in sig[:-1]]


def test_schedule_and_model_timesteps():
    sig = sigma_schedule(16, 3.0)
    assert sig.shape == (17,) and sig[0] == 1 and sig[-1] == 0
    assert (sig[1:] < sig[:-1]).all()
    assert model_timesteps(sig).shape == (16,)


@pytest.mark.parametrize("steps,shift", [(16, 3.0), (20, 3.0), (12, 3.0), (6, 1.0), (10, 3.0)])
def test_model_timesteps_truncate_in_float32_as_upstream(steps, shift):
    ints = [int(round(float(t) * 1000)) for t in model_timesteps(sigma_schedule(steps, shift))]
    assert ints == _upstream_timestep_ints(steps, shift)


def test_model_timesteps_known_upstream_values():
    """The transitions where float32 and float64 truncation differ (upstream's values)."""
    ts16 = model_timesteps(sigma_schedule(16, 3.0))
    assert [round(float(ts16[k]), 6) for k in (4, 9)] == [0.9, 0.7]
    assert round(float(model_timesteps(sigma_schedule(20, 3.0))[5]), 6) == 0.9


def _reference_log_prob(v, x, prev, sigma, sigma_next, eta):
    """Float64 log N(prev; mean, std^2) averaged over elements, built from the SDE in its
    textbook form: x0 = x - s v; drift of the reverse SDE with the x0-implied score."""
    v, x, prev = v.double(), x.double(), prev.double()
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma ** 2
    dt = sigma_next - sigma
    mean = x + dt * (v - 0.5 * eta ** 2 * score)
    std = eta * math.sqrt(sigma - sigma_next)
    dist = torch.distributions.Normal(mean, torch.full_like(mean, std))
    return dist.log_prob(prev).mean(dim=(1, 2))


def test_log_prob_matches_float64_gaussian_density():
    g = torch.Generator().manual_seed(0)
    sig = sigma_schedule(8, 3.0)
    v, x = torch.randn(3, 16, 64, generator=g), torch.randn(3, 16, 64, generator=g)
    for index in (0, 3, 6):
        prev = torch.randn(3, 16, 64, generator=g) * 0.3 + x
        ref = _reference_log_prob(v, x, prev, float(sig[index]), float(sig[index + 1]), 0.3)
        got32 = flux_step(v, x, 0.3, sig, index, prev_sample=prev)[2]
        got64 = flux_step(v.double(), x.double(), 0.3, sig, index, prev_sample=prev.double())[2]
        assert got32.dtype == torch.float32
        assert torch.allclose(got32.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.allclose(got64, ref, rtol=1e-12, atol=1e-12)


def test_rescoring_a_sampled_transition_gives_ratio_one():
    g = torch.Generator().manual_seed(1)
    sig = sigma_schedule(8, 3.0)
    v, x = torch.randn(4, 16, 64, generator=g), torch.randn(4, 16, 64, generator=g)
    sample, _, logp_rollout = flux_step(v, x, 0.3, sig, 2, generator=g)
    logp_train = flux_step(v, x, 0.3, sig, 2, prev_sample=sample)[2]
    assert torch.equal(torch.exp(logp_train - logp_rollout), torch.ones(4))


def test_per_sample_indices_match_scalar_index():
    g = torch.Generator().manual_seed(2)
    sig = sigma_schedule(8, 3.0)
    v, x, prev = (torch.randn(3, 16, 64, generator=g) for _ in range(3))
    idx = torch.tensor([0, 4, 6])
    batched = flux_step(v, x, 0.3, sig, idx, prev_sample=prev)
    for i, k in enumerate(idx.tolist()):
        single = flux_step(v[i:i + 1], x[i:i + 1], 0.3, sig, k, prev_sample=prev[i:i + 1])
        assert torch.allclose(batched[1][i], single[1][0], atol=1e-6)
        assert torch.allclose(batched[2][i], single[2][0], atol=1e-5)


def test_ode_mean_without_grpo():
    sig = sigma_schedule(4, 1.0)
    v, x = torch.ones(1, 2, 4), torch.zeros(1, 2, 4)
    mean, x0 = flux_step(v, x, 0.3, sig, 0, grpo=False, sde_solver=False)
    assert torch.allclose(mean, x + (sig[1] - sig[0]) * v)
    assert torch.allclose(x0, x - sig[0] * v)
