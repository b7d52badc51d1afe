"""--jagg_reuse_rollout: the middle members of a JAGG group take the rollout's own model outputs.

Exact while the parameters are the rollout's (before the step's first optimizer step): checked
against the explicit-Jacobian float64 reference and against recomputation, on the toy and on the
trainer in float64; and the trainer never hands a sample's rollout outputs to the update after an
optimizer step in mode on_policy."""
import functools

import pytest
import torch

import dancegrpo.train_grpo_flux as flux
from dancegrpo.algo import grpo
from dancegrpo import trainer
from dancegrpo.algo import objective
from jagg_patch import SeamError, apply_jagg, check_seams, jagg_group_backward, make_policy_update, revert_jagg
from jagg_patch.cli import add_jagg_args, jagg_plan_text
from jagg_toy import NonlinearVelocity, Problem, flat_grad, jagg_reference, rel_err

from helpers import FAST, captured_step, float64_setup, keep_rollout_outputs

T = [0.95, 0.9, 0.8, 0.7]
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def rollout_outputs(problem, model):
    """Every member's output from ONE batched forward of `model` (as a rollout would compute them),
    not through problem.predict."""
    width, m = problem.z.shape[0], problem.z.shape[1]
    with torch.no_grad():
        z = problem.z.reshape(width * m, *problem.z.shape[2:])
        t = torch.stack([problem.t_of(j) for j in range(width)]).reshape(-1)
        return model(z, t).reshape(problem.z.shape)


def run(problem, backward, reuse):
    problem.model.zero_grad(set_to_none=True)
    result = jagg_group_backward(problem.predict, problem.step_loss, problem.t, "jagg", "timestep", backward,
                                 reuse=reuse)
    return flat_grad(problem.model), result


@pytest.mark.parametrize("backward", ["joint", "split"])
def test_reused_middles_give_the_jagg_gradient_float64(backward):
    problem = Problem(NonlinearVelocity(), T)
    outputs = rollout_outputs(problem, problem.model)
    g, result = run(problem, backward, lambda j: outputs[j])
    assert rel_err(g, jagg_reference(problem)) < 1e-12
    assert (result.forwards_grad, result.forwards_nograd, result.forwards_reused) == (2, 0, 2)
    g_fresh, fresh = run(problem, backward, None)
    assert (fresh.forwards_nograd, fresh.forwards_reused) == (2, 0)
    assert rel_err(g, g_fresh) < 1e-12


def test_stale_outputs_change_the_gradient():
    """The reused outputs really enter the gradient: those of other parameters move it."""
    problem = Problem(NonlinearVelocity(), T)
    stale = rollout_outputs(problem, NonlinearVelocity(seed=5))
    g, _ = run(problem, "joint", lambda j: stale[j])
    assert rel_err(g, jagg_reference(problem)) > 1e-3


# ---------------------------------------------------------------- the trainer, float64

def grads_of(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("backward", ["joint", "split"])
def test_trainer_on_policy_reuse_equals_recomputation_float64(make_args, backward):
    """Rollout outputs from one forward over all samples; the update in micro-batches of 3."""
    args, ctx, cond, rollout, adv = float64_setup(make_args, 3)
    n, S = adv.numel(), args.sampling_steps
    keep_rollout_outputs(ctx, rollout, cond)
    steps = grpo.choose_train_steps(n, S - 1, 4, torch.Generator().manual_seed(1))
    normaliser = args.gradient_accumulation_steps * 4

    def update(reuse, on_policy):
        ctx.transformer.zero_grad(set_to_none=True)
        stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, normaliser,
                                                   make_policy_update(window=4, jagg_frac=1.0, backward=backward, reuse=reuse),
                                                   on_policy=on_policy)
        return grads_of(ctx.transformer), stats

    fresh, fresh_stats = update("off", True)
    reused, stats = update("on_policy", True)
    assert rel_err(reused, fresh) < 1e-12          # measured: ~1e-16 (batching only)
    assert (fresh_stats.forwards_reused, stats.forwards_reused) == (0, 2 * n)
    _, after_step = update("on_policy", False)     # the batch says an optimizer step has run
    assert after_step.forwards_reused == 0
    _, stale = update("always", False)
    assert stale.forwards_reused == 2 * n


# ---------------------------------------------------------------- the trainer end to end

def step_with_spy(make_args, monkeypatch, reuse, *argv):
    """One train_one_step with 8 samples (test_jagg_window's captured_step); records (on_policy,
    samples) of every rollout_output read; returns the record, the reads and the flat gradient."""
    apply_jagg(trainer_module=flux, window=4, jagg_frac=1.0, reuse=reuse)
    reads, original = [], trainer.make_update_batch

    @functools.wraps(original)   # the seam check reads the signature
    def spying(*a, **k):
        batch = original(*a, **k)
        if batch.rollout_output is not None:
            inner, on_policy, rows = batch.rollout_output, batch.on_policy, a[4].tolist()

            def read(ks):
                reads.append((on_policy, rows))
                return inner(ks)
            batch.rollout_output = read
        return batch

    monkeypatch.setattr(trainer, "make_update_batch", spying)     # the tools call it from here,
    monkeypatch.setattr(objective, "make_update_batch", spying)   # the update loop from its home
    record, grads, _ = captured_step(make_args, *argv)
    return record, reads, [torch.cat([g.reshape(-1) for g in step]) for step in grads]


def test_on_policy_never_reuses_after_an_optimizer_step(make_args, monkeypatch):
    # GA 4 of 8 samples: samples 0-3 before the first optimizer step, 4-7 after it
    record, reads, _ = step_with_spy(make_args, monkeypatch, "on_policy", "--gradient_accumulation_steps", 4)
    assert reads and all(on_policy for on_policy, _ in reads)
    assert {i for _, rows in reads for i in rows} == {0, 1, 2, 3}
    assert record["transformer_forwards_reused"] == 2 * 4
    rollout_forwards = 8 * 8  # 8 samples x S 8
    assert record["transformer_forwards_nograd"] - rollout_forwards == 2 * 4   # samples 4-7 forward theirs
    assert record["transformer_backwards"] == 2 * 8


def test_always_reuses_after_the_optimizer_step(make_args, monkeypatch):
    record, reads, _ = step_with_spy(make_args, monkeypatch, "always", "--gradient_accumulation_steps", 4)
    assert {i for _, rows in reads for i in rows} == set(range(8))
    assert any(not on_policy for on_policy, _ in reads)
    assert record["transformer_forwards_reused"] == 2 * 8
    assert record["transformer_forwards_nograd"] == 8 * 8


def test_reuse_off_keeps_no_outputs_and_matches_on_policy(make_args, monkeypatch):
    off, reads, off_grads = step_with_spy(make_args, monkeypatch, "off")
    assert not reads and off["transformer_forwards_reused"] == 0
    revert_jagg()
    on, _, on_grads = step_with_spy(make_args, monkeypatch, "on_policy")   # GA covers the rollout
    assert on["transformer_forwards_reused"] == 2 * 8
    # float32: the rollout forwards 8 samples at once, the update 4; the float64 test is the exact one
    assert rel_err(on_grads[0], off_grads[0]) < 1e-5
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-4, abs=1e-9)


def test_vanilla_rollout_keeps_no_outputs(make_args, monkeypatch):
    kept = []
    original = trainer.sample_reference_model
    monkeypatch.setattr(trainer, "sample_reference_model",
                        lambda *a, **k: kept.append(original(*a, **k).outputs) or original(*a, **k))
    args = make_args(*FAST)
    ctx = trainer.setup(args, flux.FAMILY(args))
    ctx.step = 1
    record = flux.train_one_step(ctx)
    ctx.counter.remove()
    assert kept == [None] and record["transformer_forwards_reused"] == 0


# ---------------------------------------------------------------- seam and plan

def test_seam_check_needs_the_policy_update_attribute(monkeypatch):
    def bare(batch):
        return grpo.UpdateStats()
    monkeypatch.setattr(grpo, "policy_update", bare)
    with pytest.raises(SeamError, match="uses_rollout_outputs"):
        check_seams(flux)


def test_plan_states_saved_forwards_and_memory(cache_dir, tmp_path):
    from dancegrpo.args import parse_args
    base = ["--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", str(tmp_path), "--h", "720", "--w", "720",
            "--sampling_steps", "16", "--timestep_fraction", "0.6", "--train_batch_size", "2",
            "--num_generations", "12", "--gradient_accumulation_steps", "12"]
    plan = lambda *extra: jagg_plan_text(parse_args(add_jagg_args(flux.build_parser()), base + list(extra)))  # noqa: E731
    text = plan()
    # 9 trained -> groups 4J 4J 1E: 4 middles; GA 12 of 24 samples; 16 x 45 x 45 x 64 x 4 B = 7.91 MiB
    assert "rollout reuse on_policy: 4 no-grad forwards per sample taken from the rollout for 12 of the 24" in text
    assert "2 per sample on average; keeps 7.91 MiB per sample, 189.8 MiB per rank at 720x720" in text
    assert "rollout reuse off: every middle member is forwarded" in plan("--jagg_reuse_rollout", "off")
    # Under bf16 autocast the outputs are kept as the model computes them: 2 B an element, half
    assert "keeps 3.96 MiB per sample, 94.9 MiB per rank at 720x720" in plan("--mixed_precision", "bf16")


def test_staleness_tool_compares_stale_with_fresh(cache_dir, tmp_path):
    from jagg_patch.tools import staleness
    result = staleness.main(["dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                             "--output_dir", str(tmp_path), *map(str, FAST), "--stale_steps", "1",
                             "--stale_json", str(tmp_path / "stale.json")])
    on_policy, after = result["rows"]
    assert on_policy["optimizer_steps"] == 0 and on_policy["weight_change"] == 0
    assert on_policy["cos"] == pytest.approx(1.0, abs=1e-6)       # before any step: the same outputs
    assert after["weight_change"] > 0 and after["cos"] < 1 - 1e-4  # after one: stale outputs move it
    assert (tmp_path / "stale.json").is_file()
