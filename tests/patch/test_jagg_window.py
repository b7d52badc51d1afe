"""The authors' variant through the real trainer (tiny Flux): window grouping, index alpha and
split backward against float64 references, pass counts end to end, vanilla untouched by the
new seam, the activation-peak metric, and the launcher's checks and plan."""
import pytest
import torch

import dancegrpo.algo.grpo as grpo
import dancegrpo.train_grpo_flux as flux
from authors_reference import authors_window_backward
from dancegrpo import trainer
from jagg_patch import apply_jagg, make_policy_update, make_window_selection
from helpers import captured_step, float64_setup, grads_of, reference_loss, relative_error

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
W = 3   # tiny preset: S 8 -> 7 transitions -> windows (0, 1, 2), (3, 4, 5), (6,)



def window_selection(n, seed=3, fraction=0.7):
    sel = make_window_selection(W)(n, 7, fraction, torch.Generator().manual_seed(seed))
    assert sel.num_train == 2 * W and sel.steps.shape == (n, 2 * W)   # int(3 * 0.7) = 2 windows
    short = int((sel.steps[:, -1] == -1).sum())
    assert 0 < short < n   # some samples drew the one-member window, some did not
    return sel


@pytest.mark.parametrize("update_batch_size", [1, 3])
def test_window_exact_mode_equals_float64_per_step_reference(make_args, update_batch_size):
    args, ctx, cond, rollout, adv = float64_setup(make_args, update_batch_size)
    n = adv.numel()
    sel = window_selection(n)
    normaliser = args.gradient_accumulation_steps * 2 * W    # GA * n_trained_windows * W, as the authors
    params = [p for p in ctx.transformer.parameters() if p.requires_grad]
    ref = torch.autograd.grad(reference_loss(ctx.transformer, rollout, cond, adv, sel.steps, ctx.sigmas, args,
                                             normaliser), params)
    update = make_policy_update(window=W, jagg_frac=1.0, mode="exact", grouping="window")
    stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), sel.steps, normaliser,
                                               update)
    assert relative_error(grads_of(ctx.transformer), ref) < 1e-10
    assert stats.exact_groups == 2 * n and stats.jagg_groups == 0
    # one autograd call per member of each window that some sample of a micro-batch trains
    sizes = {0: 3, 1: 3, 2: 1}
    calls = sum(sizes[g] for start in range(0, n, update_batch_size)
                for g in {k // W for k in sel.steps[start:start + update_batch_size].flatten().tolist() if k >= 0})
    assert stats.backward_calls == calls


def test_window_index_split_equals_the_authors_schedule(make_args):
    """Batched (micro-batches of 3, sub-batches per window) against one sample and one window at
    a time through tests/authors_reference.py, in float64."""
    args, ctx, cond, rollout, adv = float64_setup(make_args, 3)
    n = adv.numel()
    sel = window_selection(n)
    normaliser = args.gradient_accumulation_steps * 2 * W
    update = make_policy_update(window=W, jagg_frac=1.0, mode="jagg", alpha="index", backward="split", grouping="window")
    stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), sel.steps, normaliser,
                                               update)
    got = grads_of(ctx.transformer)
    ctx.transformer.zero_grad(set_to_none=True)
    for i in range(n):
        batch = trainer.make_update_batch(ctx, rollout, cond, adv, torch.tensor([i]), sel.steps[i:i + 1], normaliser)
        row = [k for k in sel.steps[i].tolist() if k >= 0]
        for start in sorted({k - k % W for k in row}):
            members = [torch.tensor([k]) for k in row if start <= k < start + W]
            if len(members) == 1:
                batch.step_loss(members[0], batch.predict(members[0])).backward()
            else:
                authors_window_backward(lambda j: batch.predict(members[j]),
                                        lambda j, v: batch.step_loss(members[j], v), len(members))
    ref = grads_of(ctx.transformer)
    assert relative_error(got, ref) < 1e-10
    with_window_0 = int((sel.steps[:, 0] == 0).sum())
    with_window_1 = int((sel.steps == 3).any(dim=1).sum())
    assert stats.jagg_groups == with_window_0 + with_window_1
    # and it is an approximation: not the exact per-step gradient of the same windows
    ctx.transformer.zero_grad(set_to_none=True)
    trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), sel.steps, normaliser,
                                       make_policy_update(window=W, jagg_frac=1.0, mode="exact", grouping="window"))
    assert relative_error(got, grads_of(ctx.transformer)) > 1e-6


def test_window_counts_end_to_end(make_args, monkeypatch):
    # jagg_frac 0.3 -> round_half_up(0.9) = 1: window 0 JAGG, window 1 exact (3), window 2 exact (1)
    apply_jagg(trainer_module=flux, window=W, jagg_frac=0.3, grouping="window", alpha="index", backward="split")
    drawn, patched = [], flux.select_train_steps
    monkeypatch.setattr(flux, "select_train_steps", lambda *a, **k: drawn.append(patched(*a, **k)) or drawn[-1])
    record, _, _ = captured_step(make_args, "--timestep_fraction", "0.7")
    (sel,) = drawn
    cost = {0: 2, 1: 3, 2: 1}             # backwards per window, written out from the plan above
    windows = [{k // W for k in row if k >= 0} for row in sel.steps.tolist()]
    assert all(len(w) == 2 for w in windows)
    backwards = sum(cost[g] for w in windows for g in w)
    middles = sum(1 for w in windows if 0 in w)      # window 0's middle member, without grad
    rollout = record["samples"] * 8                   # S forwards per sample, no grad
    assert record["transformer_backwards"] == record["transformer_forwards_grad"] == backwards
    assert record["transformer_forwards_nograd"] == rollout       # GA covers the rollout: middles reused
    assert record["transformer_forwards_reused"] == middles
    assert record["jagg_groups"] == middles and record["exact_groups"] == 2 * record["samples"] - middles
    assert record["train_timesteps"] == 2 * W


def test_vanilla_is_unchanged_by_the_selection_seam(make_args):
    """train_one_step (through select_train_steps) against the update as it was written before
    the seam: choose_train_steps after the advantages, normaliser GA * int((S-1) * fraction)."""
    record, (got,), ctx = captured_step(make_args)
    args = ctx.args
    ref_ctx = trainer.setup(args, flux.FAMILY(args))
    noise_gen, host_gen = trainer.step_generators(ref_ctx, 1)
    cond, captions = trainer.expand_groups(args, next(ref_ctx.loader))
    rollout = trainer.sample_reference_model(ref_ctx, cond, captions, noise_gen)
    adv = trainer.compute_advantages(ref_ctx, rollout.rewards, rollout.rewards, host_gen)
    n_train = int((args.sampling_steps - 1) * args.timestep_fraction)
    steps = grpo.choose_train_steps(len(captions), args.sampling_steps - 1, n_train, host_gen)
    ref_ctx.transformer.train()
    trainer.accumulate_policy_gradient(ref_ctx, rollout, cond, adv, torch.arange(len(captions)), steps,
                                       args.gradient_accumulation_steps * n_train, grpo.policy_update)
    ref = grads_of(ref_ctx.raw_transformer)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    assert record["train_timesteps"] == n_train
    ref_ctx.counter.remove()


def test_activation_peak_metric_joint_vs_split(make_args):
    """The metric is there, graphs are all freed after the step, and the split backward's peak
    is below the joint one's (one endpoint graph alive instead of two)."""
    peaks = {}
    for backward in ("joint", "split"):
        apply_jagg(trainer_module=flux, window=4, jagg_frac=1.0, backward=backward)
        record, _, ctx = captured_step(make_args, "--update_batch_size", "8")
        assert ctx.activation_meter.live_bytes == 0
        peaks[backward] = record["activation_peak_mb"]
    assert 0 < peaks["split"] < 0.75 * peaks["joint"]


def test_activation_peak_with_checkpointing(make_args):
    """Under activation checkpointing the meter still measures, and sees less than without."""
    plain, _, _ = captured_step(make_args)
    ckpt, _, ctx = captured_step(make_args, "--gradient_checkpointing")
    assert 0 < ckpt["activation_peak_mb"] < plain["activation_peak_mb"]
    assert ctx.activation_meter.live_bytes == 0
