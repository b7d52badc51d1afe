"""The digits_large world (--preset digits_large): its build spec (a deeper transformer whose MLP input
projections start scaled), and the shipped models' records within the budgets they were built to.
(Its models run in one test: benchmarks/digits_large.sh's smoke test.)"""
import json
import os

import pytest
import torch

from dancegrpo.digits.build import digits_world, make_transformer
from dancegrpo.models.preset_defaults import DIGITS_LARGE_DIR

FAMILIES = {"flux": "dancegrpo.train_grpo_flux", "qwenimage": "dancegrpo.train_grpo_qwenimage"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_large_world_scales_exactly_the_named_mlp_inputs(family):
    """Against diffusers' own initialisation from the same seed: the named MLP input projections are
    mlp_gain times it, every other tensor is equal; the default world keeps diffusers' as it is."""
    import diffusers
    large, default = digits_world(family, "digits_large"), digits_world(family)
    cls, config = large.transformer
    torch.manual_seed(3)
    reference = getattr(diffusers, cls)(**config).state_dict()
    torch.manual_seed(3)
    built = make_transformer(large).state_dict()
    scaled = {k for k in reference if k.endswith(".weight") and k[:-len(".weight")].endswith(large.mlp_inputs)}
    assert len(scaled) >= 2 * config.get("num_layers", 1)
    for key, value in reference.items():
        assert torch.equal(built[key], value * large.mlp_gain if key in scaled else value), key
    torch.manual_seed(3)
    unchanged = make_transformer(default).state_dict()
    torch.manual_seed(3)
    assert all(torch.equal(unchanged[k], v) for k, v in getattr(diffusers, default.transformer[0])(
        **default.transformer[1]).state_dict().items())


def test_a_world_that_names_no_module_or_is_unknown_is_refused():
    world = digits_world("flux", "digits_large")
    world.mlp_inputs = ("no_such_projection",)
    with pytest.raises(ValueError, match="names the wrong MLP projections"):
        make_transformer(world)
    with pytest.raises(ValueError, match="has no 'digits_huge' world"):
        digits_world("flux", "digits_huge")


def package_mib(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files) / 2 ** 20


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shipped_large_world_is_within_its_budgets(family):
    """The build records of the shipped models (`python -m dancegrpo.digits.build --world digits_large`;
    benchmarks/digits_large.sh's smoke test runs them): the large world, trained in <= 30 min, the base model's held-out rate <= 0.75 (room to
    learn); its files <= 25 MB in all; the preset trains at upstream's geometry."""
    from dancegrpo.presets import preset_spec
    with open(os.path.join(DIGITS_LARGE_DIR, family, "BUILD.json")) as f:
        record = json.load(f)
    assert record["world"] == "digits_large" and record["mlp_gain"] == digits_world(family, "digits_large").mlp_gain
    assert record["vae_time_s"] + record["transformer_time_s"] <= 30 * 60
    assert 0.2 < record["heldout_rate_ode"] <= 0.75
    assert package_mib(DIGITS_LARGE_DIR) <= 25
    defaults = preset_spec(family, "digits_large")["defaults"]
    assert defaults["sampling_steps"] == {"flux": 16, "qwenimage": 20}[family] and defaults["timestep_fraction"] == 0.6


def load_factor_sweep():
    from helpers import load_benchmark_script
    return load_benchmark_script("linearity_factors")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_factor_sweep_changes_one_thing_per_factor(family):
    """benchmarks/linearity_factors.py: each factor's transformer differs from the base configuration
    in the named keys only, trains as long as its world's build does (x its multiplier: `large` on
    Qwen-Image 700 steps, as shipped), and its init gains scale exactly the named tensors."""
    sweep = load_factor_sweep()
    base = digits_world(family)
    for factor, (_, config, world_changes, gains, multiplier) in sweep.FACTORS.items():
        world = sweep.factor_world(family, factor)
        expected = digits_world(family, "digits_large") if config is None else base
        assert sweep.training_steps(world, factor) == expected.transformer_steps * multiplier, factor
        assert sweep.training_steps(world, factor, 10) == 10 * multiplier
        if config is not None:
            changed = {k for k in world.transformer[1] if world.transformer[1][k] != base.transformer[1].get(k)}
            assert changed == set(config.get(family, {})), factor
            assert world.mlp_gain == world_changes.get("mlp_gain", 1.0), factor
    torch.manual_seed(0)
    transformer = make_transformer(base)
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    gains = sweep.FACTORS["qk_gain"][3]
    sweep.scale_init(transformer, gains)
    (suffixes, gain), = gains.items()
    scaled = [k for k in before if k.endswith(".weight") and k[:-len(".weight")].endswith(suffixes)]
    assert scaled
    for key, value in transformer.state_dict().items():
        assert torch.equal(value, before[key] * gain if key in scaled else before[key]), key
    with pytest.raises(SystemExit, match="no module ends with"):
        sweep.scale_init(transformer, {("no_such_norm",): 2.0})
