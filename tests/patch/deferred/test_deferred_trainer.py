"""--jagg_deferred on this project's trainer: its own (vanilla) update, unpatched, through the proxy
gives the restated update's gradient (float64, to 1e-12) for W 2-8, jagg_frac 0.6 / 1, both alpha
rules, reuse off / on, micro-batches of 1 and more, accumulation over micro-batches; end to end
through the launcher the same records; and the flags it cannot run with are refused in one line."""
import os
import sys

import pytest
import torch

from dancegrpo import trainer
from dancegrpo.algo import grpo
from helpers import FAST, REPO_ROOT, captured_step, float64_setup, keep_rollout_outputs, read_metrics, relative_error, run_main
from jagg_patch import JaggConfig, apply_deferred, make_policy_update, make_window_selection
from jagg_patch import deferred

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def flat_grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad and p.grad is not None])


def both_updates(make_args, config, micro_batch, trained=4, shared_noise=False, steps_flags=()):
    """(deferred gradient, restated gradient, the proxy's stats) of one accumulation over every sample:
    the rollout's calls run through the proxy (one call per transition over all samples, in order).
    Under the window grouping the samples train the windows the authors' selection draws."""
    args, ctx, cond, rollout, adv = float64_setup(make_args, micro_batch, *steps_flags, shared_noise=shared_noise)
    n, S = adv.numel(), args.sampling_steps
    raw = ctx.transformer
    window = config.grouping == "window"
    proxy = deferred.wrap(raw, config, transitions=S - 1 if window else None).attach(ctx.optimizer)
    ctx.transformer = proxy
    keep_rollout_outputs(ctx, rollout, cond)   # the rollout's calls, through the proxy
    if window:
        selection = make_window_selection(config.window)(n, S - 1, args.timestep_fraction,
                                                         torch.Generator().manual_seed(1))
        steps, trained = selection.steps, selection.num_train
    else:
        steps = grpo.choose_train_steps(n, S - 1, trained, torch.Generator().manual_seed(1))
    normaliser = args.gradient_accumulation_steps * trained
    raw.zero_grad(set_to_none=True)
    ctx.transformer.train()
    trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, normaliser,
                                       grpo.policy_update, on_policy=True)
    proxy.flush()
    got = flat_grads(raw)
    proxy.close()
    ctx.transformer = raw
    raw.zero_grad(set_to_none=True)
    trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, normaliser,
                                       make_policy_update(config), on_policy=True)
    return got, flat_grads(raw), proxy.stats[-1]


@pytest.mark.parametrize("window, frac, alpha, reuse", [
    (2, 1.0, "timestep", "off"), (3, 0.6, "index", "on_policy"), (4, 1.0, "timestep", "on_policy"),
    (4, 0.6, "timestep", "off"), (8, 1.0, "index", "on_policy")])
@pytest.mark.parametrize("micro_batch", [1, 3])
def test_deferred_equals_the_restated_update_float64(make_args, window, frac, alpha, reuse, micro_batch):
    config = JaggConfig(window=window, jagg_frac=frac, alpha=alpha, reuse=reuse)
    trained = 6 if window == 8 else 4
    got, ref, stats = both_updates(make_args, config, micro_batch, trained)
    assert relative_error(got, ref) < 1e-12
    assert stats.exact_rows == stats.rows_exact.get("routed exact", 0)   # every row placed
    # on_policy: every call's rows come from the rollout (no optimizer step in one accumulation)
    assert stats.forwards_reused == (stats.rows_deferred if reuse == "on_policy" else 0)


def test_deferred_counts_are_the_restated_ones(make_args):
    """W 4, jagg_frac 1, reuse on: 8 samples x 1 group; 2 replayed rows and their backwards per
    sample (but where the PPO clip zeroes a folded signal: not replayed); no call-time forward (the
    rollout's outputs, before the optimizer step)."""
    config = JaggConfig(window=4, jagg_frac=1.0)
    _, _, stats = both_updates(make_args, config, 4)
    assert stats.jagg_groups == 8 and stats.endpoint_rows + stats.zero_rows == 16 and stats.zero_rows > 0
    assert stats.forwards_grad == stats.endpoint_rows
    assert stats.backward_calls == 4   # chunks of the loop's call size (4 rows)
    assert (stats.forwards_nograd, stats.forwards_reused) == (0, 32)   # rollout and update return alike


def test_launcher_runs_deferred_as_the_restated_update(make_args, cache_dir, tmp_path, capsys):
    """`python -m jagg_patch ... --jagg_deferred`: one step's gradient and record as the restated
    update's (float32: equal to rounding), the proxy's counts in the record."""
    pytest.importorskip("matplotlib", reason="the trainer draws its reward curve with matplotlib, which an install "
                                             "with --no-deps lacks")
    flags = ["--jagg_window", "4", "--jagg_frac", "1", "--no-init_same_noise"]
    from jagg_patch import apply_jagg
    import dancegrpo.train_grpo_flux as flux
    apply_jagg(JaggConfig(window=4, jagg_frac=1.0, backward="split"), trainer_module=flux)
    restated, restated_grads, _ = captured_step(make_args, "--no-init_same_noise")
    apply_deferred(JaggConfig(window=4, jagg_frac=1.0), trainer_module=flux)
    record, grads, _ = captured_step(make_args, "--no-init_same_noise")
    assert relative_error(grads[0], restated_grads[0]) < 1e-5
    for name in ("transformer_backwards", "jagg_groups", "exact_groups"):
        assert record[name] == restated[name], name
    assert record["deferred_rows_deferred"] == 32 and record["deferred_exact_rows"] == 0
    out = tmp_path / "run"
    assert run_main("jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                    "--output_dir", out, "--max_train_steps", "1", *FAST, *flags, "--jagg_deferred") == 0
    assert "deferred (jagg_patch.deferred, the trainer's update unpatched)" in capsys.readouterr().out
    (line,) = read_metrics(out)
    assert line["deferred_jagg_groups"] == 8 and line["transformer_backwards"] == 16


@pytest.mark.parametrize("window, frac, alpha, reuse", [
    (4, 0.6, "timestep", "on_policy"), (3, 1.0, "index", "off"), (2, 1.0, "timestep", "on_policy"),
    (4, 1.0, "timestep", "off")])
@pytest.mark.parametrize("micro_batch", [1, 3])
def test_shared_initial_noise_is_placed_as_the_restated_update_groups_it(make_args, window, frac, alpha, reuse,
                                                                         micro_batch):
    """--init_same_noise (the presets' and upstream's recipes): a prompt group's first-step rows are one
    row of the rollout; the flush places them with the samples that trained their first step (each a row
    short of the others), so the gradient is the restated update's, float64, to 1e-12, and no row trains
    exactly but by routing; their call-time outputs come from the rollout like every other row's."""
    config = JaggConfig(window=window, jagg_frac=frac, alpha=alpha, reuse=reuse)
    got, ref, stats = both_updates(make_args, config, micro_batch, shared_noise=True)
    assert relative_error(got, ref) < 1e-12
    assert stats.shared_placed > 0 and stats.exact_rows == stats.rows_exact.get("routed exact", 0)
    assert stats.forwards_reused == (stats.rows_deferred if reuse == "on_policy" else 0)


@pytest.mark.parametrize("window, frac, alpha, shared_noise", [
    (4, 1.0, "index", False), (2, 0.5, "timestep", False), (4, 1.0, "index", True), (2, 1.0, "timestep", True)])
@pytest.mark.parametrize("micro_batch", [1, 3])
def test_the_window_grouping_is_the_restated_update_float64(make_args, window, frac, alpha, shared_noise, micro_batch):
    """The authors' grouping (S 9: 8 trainable transitions; W 4: 2 windows, 1 trained per sample; W 2:
    4 windows, 2 trained, at jagg_frac 0.5 windows 0-1 JAGG and 2-3 exact): each row's window told by its
    rollout position, routed by the window's index; the gradient is the restated update's, to 1e-12."""
    config = JaggConfig(window=window, jagg_frac=frac, alpha=alpha, grouping="window")
    got, ref, stats = both_updates(make_args, config, micro_batch, shared_noise=shared_noise,
                                   steps_flags=("--sampling_steps", 9))
    assert relative_error(got, ref) < 1e-12
    assert stats.exact_rows == stats.rows_exact.get("routed exact", 0) and stats.jagg_groups > 0
    assert (stats.rows_exact.get("routed exact", 0) > 0) == (frac < 1)
    assert (stats.shared_placed > 0) == shared_noise


def test_a_window_the_loop_trains_only_part_of_trains_exactly(make_args):
    """A loop left as it is that trains part of a window (here vanilla's own random subset under the
    window grouping): those rows train exactly, counted by their reason; the whole windows by JAGG."""
    args, ctx, cond, rollout, adv = float64_setup(make_args, 2, "--sampling_steps", 9)
    n = adv.numel()
    proxy = deferred.wrap(ctx.transformer, JaggConfig(window=2, jagg_frac=1.0, grouping="window"), transitions=8)
    raw, ctx.transformer = ctx.transformer, proxy.attach(ctx.optimizer)
    keep_rollout_outputs(ctx, rollout, cond)
    steps = torch.tensor([[0, 1, 2, 3, 4]] * n)   # windows 0 and 1 whole, 2 only half
    trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, 10, grpo.policy_update,
                                       on_policy=True)
    stats = proxy.flush()
    proxy.close()
    ctx.transformer = raw
    assert stats.jagg_groups == 2 * n and stats.rows_exact == {"window not trained whole": n}


def test_a_window_that_does_not_divide_the_trajectory_is_refused():
    with pytest.raises(deferred.DeferredError, match="needs the window \\(4\\) to divide the 7 trainable"):
        deferred.wrap(torch.nn.Linear(2, 2), JaggConfig(window=4, grouping="window"), timestep="input",
                      transitions=7)
    with pytest.raises(deferred.DeferredError, match="transitions=S-1"):
        deferred.wrap(torch.nn.Linear(2, 2), JaggConfig(window=4, grouping="window"), timestep="input")


def test_the_window_grouping_through_the_trainer(make_args):
    """The trainer draws the authors' windows (its select_train_steps seam) and its own update trains
    them through the proxy: one step's gradient and counts as the restated window grouping's."""
    import dancegrpo.train_grpo_flux as flux
    from jagg_patch import apply_jagg
    config = dict(window=4, jagg_frac=1.0, grouping="window", alpha="index")
    flags = ("--no-init_same_noise", "--sampling_steps", "9")
    apply_jagg(JaggConfig(backward="split", **config), trainer_module=flux)
    restated, restated_grads, _ = captured_step(make_args, *flags)
    apply_deferred(JaggConfig(**config), trainer_module=flux)
    record, grads, _ = captured_step(make_args, *flags)
    assert relative_error(grads[0], restated_grads[0]) < 1e-5
    for name in ("transformer_backwards", "jagg_groups", "exact_groups"):
        assert record[name] == restated[name], name
    assert record["deferred_exact_rows"] == 0 and record["deferred_jagg_groups"] == restated["jagg_groups"]


def test_shared_noise_through_the_trainer(make_args):
    """The trainer's own rollout and update (the tiny preset draws one noise per prompt group): every
    identical row placed, none forwarded at call time (one optimizer step: every call on-policy)."""
    import dancegrpo.train_grpo_flux as flux
    apply_deferred(JaggConfig(window=4, jagg_frac=1.0), trainer_module=flux)
    record, _, _ = captured_step(make_args)
    assert record["deferred_shared_placed"] > 0 and record["deferred_exact_rows"] == 0
    assert record["deferred_forwards_nograd"] == 0
    assert record["deferred_forwards_reused"] == record["deferred_rows_deferred"]


@pytest.mark.parametrize("flags, message", [
    (["--engine", "deepspeed", "--deepspeed_config", os.path.join(REPO_ROOT, "configs", "deepspeed", "zero2.json")],
     "does not drive DeepSpeed"),
    (["--jagg_grouping", "window"], "needs --jagg_window to divide the S-1 = 7 trainable transitions"),
    (["--jagg_frac", "auto"], "no fidelity monitor"),
    (["--jagg_monitor_every", "2"], "no fidelity monitor")])
@pytest.mark.parametrize("deepspeed_installed", [True, False], ids=["deepspeed", "no-deepspeed"])
def test_flags_deferred_cannot_run_with_are_one_line(cache_dir, tmp_path, capsys, monkeypatch, flags, message,
                                                     deepspeed_installed):
    """Refused whatever the environment: without DeepSpeed the combination is refused, not an install asked for."""
    if not deepspeed_installed:
        monkeypatch.setitem(sys.modules, "deepspeed", None)   # `import deepspeed` raises ImportError
    assert run_main("jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                    "--output_dir", tmp_path, "--jagg_deferred", *flags) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "metrics.jsonl")


def test_bf16_through_the_trainer(make_args):
    """--mixed_precision bf16 (a GPU's dtype path under autocast): the deferred step's gradient is the
    restated one's up to bf16 rounding, and every replay is within the guard's bound."""
    import dancegrpo.train_grpo_flux as flux
    from jagg_patch import apply_jagg
    flags = ("--no-init_same_noise", "--mixed_precision", "bf16")
    apply_jagg(JaggConfig(window=4, jagg_frac=1.0, backward="split"), trainer_module=flux)
    _, restated, _ = captured_step(make_args, *flags)
    apply_deferred(JaggConfig(window=4, jagg_frac=1.0), trainer_module=flux)
    record, grads, _ = captured_step(make_args, *flags)
    assert record["deferred_max_replay_diff"] <= record["deferred_replay_bound"]
    assert record["deferred_replay_bound"] > 1e-3   # bf16's bound, not float32's
    assert relative_error(grads[0], restated[0]) < 1e-2
