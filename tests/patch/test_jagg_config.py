"""JaggConfig: one frozen object, checked once when made, passed as it is by every entry point."""
import dataclasses

import pytest

import dancegrpo.train_grpo_flux as flux
from jagg_patch import JaggConfig, apply_jagg, make_policy_update, revert_jagg
from jagg_patch import config as config_module


@pytest.mark.parametrize("kw, match", [
    (dict(window=1), "window"), (dict(jagg_frac=1.5), "jagg_frac"), (dict(mode="fast"), "mode"),
    (dict(alpha="linear"), "alpha rule"), (dict(backward="both"), "backward"), (dict(grouping="x"), "grouping"),
    (dict(reuse="sometimes"), "rollout reuse"), (dict(monitor_every=-1), "monitor_every"),
    (dict(monitor_samples=0), "monitor_samples"), (dict(min_cos=1.5), "min_cos"),
    (dict(jagg_frac="auto"), "monitor_every N > 0"),
])
def test_a_bad_setting_is_refused_when_the_config_is_made(kw, match):
    with pytest.raises(ValueError, match=match):
        JaggConfig(**kw)
    good = JaggConfig()
    with pytest.raises(ValueError, match=match):   # a changed copy is checked as a new config
        good.replace(**kw)


def test_the_config_is_frozen_and_passed_as_it_is(monkeypatch):
    config = JaggConfig(window=3, jagg_frac=1.0, backward="split")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.window = 5
    checks = []
    real = config_module.validate_jagg_config
    monkeypatch.setattr(config_module, "validate_jagg_config", lambda *a: checks.append(a) or real(*a))
    assert make_policy_update(config).jagg_config is config
    try:
        apply_jagg(config, trainer_module=flux)
        assert flux.policy_update.jagg_config is config
    finally:
        revert_jagg()
    assert checks == []   # made once, before; nothing on the way checks it again


def test_keyword_settings_build_the_same_config():
    assert make_policy_update(window=3, jagg_frac=1.0).jagg_config == JaggConfig(window=3, jagg_frac=1.0)
    assert make_policy_update(JaggConfig(), window=3).jagg_config == JaggConfig(window=3)
    with pytest.raises(TypeError, match="JaggConfig"):
        make_policy_update({"window": 3})


def test_the_cli_flags_make_the_config():
    import argparse
    from jagg_patch.cli import add_jagg_args, monitor_for_auto
    args = add_jagg_args(argparse.ArgumentParser()).parse_args(["--jagg_window", "3", "--jagg_frac", "auto",
                                                                "--jagg_reuse_rollout", "off"])
    monitor_for_auto(args)
    assert JaggConfig.from_args(args) == JaggConfig(window=3, jagg_frac="auto", backward="auto", reuse="off",
                                                    monitor_every=10)
