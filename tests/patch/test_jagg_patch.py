"""The patch on the real trainer (tiny preset): seams, apply / revert, exact reproduction
of vanilla, pass counts, and the per-sample batching of the JAGG path."""
import types

import pytest
import torch

import dancegrpo
import dancegrpo.algo.grpo as grpo
import dancegrpo.train_grpo_flux as flux
from dancegrpo import trainer
from jagg_patch import JaggConfig, SeamError, apply_jagg, check_seams, is_patched, jagg_group_backward, revert_jagg

from helpers import FAST, captured_step

# captured_step replaces optimizer.step to read the gradients; the scheduler notices.
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def assert_grads_close(got, ref, rtol=1e-4):
    assert len(got) == len(ref) >= 1
    flat = lambda gs: torch.cat([g.reshape(-1) for step in gs for g in step])  # noqa: E731
    a, b = flat(got), flat(ref)
    assert float((a - b).norm() / b.norm()) < rtol


# ---------------------------------------------------------------- seams

def test_every_trainer_has_the_seams():
    for name in dancegrpo.TRAINERS:
        check_seams(name)


def test_check_seams_names_a_moved_or_changed_seam():
    fake = types.ModuleType("fake_trainer")
    fake.build_parser, fake.main, fake.train_one_step = (lambda: None), (lambda args: None), (lambda ctx: None)
    fake.FAMILY = type("Family", (), {"__init__": lambda self, args: None})
    with pytest.raises(SeamError, match="policy_update"):
        check_seams(fake)
    fake.policy_update = lambda batch, window: None
    with pytest.raises(SeamError, match="policy_update"):
        check_seams(fake)
    fake.policy_update = lambda batch: None
    with pytest.raises(SeamError, match="select_train_steps"):
        check_seams(fake)
    fake.select_train_steps = lambda num_samples, num_transitions, fraction, generator: None
    with pytest.raises(SeamError, match="select_train_steps"):   # a renamed parameter is a changed seam
        check_seams(fake)
    fake.select_train_steps = lambda num_samples, num_transitions, timestep_fraction, generator: None
    check_seams(fake)
    del fake.main
    with pytest.raises(SeamError, match="main"):
        check_seams(fake)


# ---------------------------------------------------------------- apply / revert

def test_apply_twice_then_revert_restores_original_objects():
    originals = {name: getattr(__import__(name, fromlist=["x"]), "policy_update") for name in dancegrpo.TRAINERS}
    apply_jagg(window=4)
    apply_jagg(window=2, jagg_frac=1.0)
    assert flux.policy_update is not originals["dancegrpo.train_grpo_flux"]
    assert flux.policy_update.jagg_config == JaggConfig(window=2, jagg_frac=1.0)
    assert flux.policy_update.jagg_config.as_dict() == dict(window=2, jagg_frac=1.0, mode="jagg", alpha="timestep",
                                                            backward="joint", grouping="trained", reuse="on_policy",
                                                            monitor_every=0, monitor_samples=8, min_cos=0.8)
    assert flux.select_train_steps is grpo.select_train_steps   # the trained grouping keeps vanilla's choice
    assert grpo.policy_update is originals["dancegrpo.train_grpo_flux"]  # the library function is untouched
    revert_jagg()
    for name, original in originals.items():
        assert getattr(__import__(name, fromlist=["x"]), "policy_update") is original
    assert not is_patched(flux)
    revert_jagg()  # reverting an unpatched module is harmless


def test_apply_rejects_bad_config_without_patching():
    with pytest.raises(ValueError, match="window"):
        apply_jagg(trainer_module=flux, window=1)
    with pytest.raises(ValueError, match="mode"):
        apply_jagg(trainer_module=flux, mode="fast")
    assert flux.policy_update is grpo.policy_update


def test_vanilla_after_revert_equals_never_patched(make_args):
    never_record, never, _ = captured_step(make_args)
    apply_jagg(trainer_module=flux, window=4, jagg_frac=1.0)
    _, jagg, _ = captured_step(make_args)
    revert_jagg(flux)
    record, after, _ = captured_step(make_args)
    for a, b in zip(after[0], never[0]):
        assert torch.equal(a, b)
    assert record["transformer_backwards"] == never_record["transformer_backwards"]
    assert not all(torch.equal(a, b) for a, b in zip(jagg[0], never[0]))  # the patch did act in between


# ---------------------------------------------------------------- exact reproduction and counts

def test_exact_mode_reproduces_vanilla(make_args):
    vanilla_record, vanilla, _ = captured_step(make_args)
    apply_jagg(trainer_module=flux, window=4, jagg_frac=1.0, mode="exact")
    record, exact, _ = captured_step(make_args)
    assert_grads_close(exact, vanilla)  # same transitions, only summed in another order (float32)
    assert record["loss"] == pytest.approx(vanilla_record["loss"], rel=1e-4, abs=1e-9)
    assert record["transformer_backwards"] == vanilla_record["transformer_backwards"]
    assert (record["jagg_groups"], record["exact_groups"]) == (0, 8)


def test_window_two_reproduces_vanilla(make_args):
    _, vanilla, _ = captured_step(make_args)
    apply_jagg(trainer_module=flux, window=2, jagg_frac=1.0)
    record, window2, _ = captured_step(make_args)
    assert record["jagg_groups"] == 2 * 8  # really routed through the JAGG code path
    assert_grads_close(window2, vanilla)


@pytest.mark.parametrize("window, frac, backwards_per_sample, jagg, exact", [
    (4, 0.6, 2, 1, 0),   # one group of 4 -> JAGG: 2 backwards instead of 4
    (3, 0.6, 3, 1, 1),   # groups (0,1,2) JAGG + (3,) exact: 2 + 1
    (2, 0.6, 4, 1, 1),   # 2 groups, round(1.2) = 1 JAGG group of 2 (costs what exact costs)
    (4, 0.0, 4, 0, 1),
])
def test_step_counts(make_args, window, frac, backwards_per_sample, jagg, exact):
    vanilla_record, _, _ = captured_step(make_args)
    apply_jagg(trainer_module=flux, window=window, jagg_frac=frac, reuse="off")  # every middle member forwarded
    record, _, _ = captured_step(make_args)
    samples, n = record["samples"], record["train_timesteps"]
    assert vanilla_record["transformer_backwards"] == n * samples
    assert record["transformer_backwards"] == backwards_per_sample * samples
    assert record["transformer_forwards_grad"] == backwards_per_sample * samples
    rollout = vanilla_record["transformer_forwards_nograd"]
    assert record["transformer_forwards_nograd"] - rollout == (n - backwards_per_sample) * samples
    assert (record["jagg_groups"], record["exact_groups"]) == (jagg * samples, exact * samples)


# ---------------------------------------------------------------- the batched seam path

def test_batched_jagg_update_equals_per_sample_groups(make_args):
    """The patched update sorts each sample's transitions and gives every sample its own
    alphas; check it against one sample at a time with scalar t (no batching involved)."""
    args = make_args(*FAST)
    ctx = trainer.setup(args, flux.FAMILY(args))
    noise_gen, host_gen = trainer.step_generators(ctx, 1)
    cond, captions = trainer.expand_groups(args, next(ctx.loader))
    rollout = trainer.sample_reference_model(ctx, cond, captions, noise_gen)
    adv = trainer.compute_advantages(ctx, rollout.rewards, rollout.rewards, host_gen)
    steps = grpo.choose_train_steps(8, 7, 4, host_gen)
    idx = torch.arange(4)

    def grads(fn):
        ctx.transformer.zero_grad(set_to_none=True)
        fn()
        return torch.cat([p.grad.reshape(-1) for p in ctx.raw_transformer.parameters()])

    from jagg_patch import make_policy_update
    batched = grads(lambda: make_policy_update(window=4, jagg_frac=1.0)(
        trainer.make_update_batch(ctx, rollout, cond, adv, idx, steps[idx], 32)))

    def one_by_one():
        for i in idx:
            b = trainer.make_update_batch(ctx, rollout, cond, adv, i[None], steps[i[None]], 32)
            ks = steps[i].sort().values
            jagg_group_backward(lambda j: b.predict(ks[j][None]), lambda j, v: b.step_loss(ks[j][None], v),
                                ctx.timesteps[ks], "jagg")
    reference = grads(one_by_one)
    assert float((batched - reference).norm() / reference.norm()) < 1e-4
    assert len(set(steps[:4, 0].tolist())) > 1  # samples really differ in their transitions
    ctx.counter.remove()
