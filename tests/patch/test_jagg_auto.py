"""--jagg_frac auto: on a velocity field built so that the answer is known (its Jacobian is exactly
affine in (z, t) over the high-noise group, strongly nonlinear over the low-noise one), the monitor
measures cos 1 where JAGG is exact, auto routes exactly that position to JAGG, and the routed
update's gradient equals the fixed-fraction update with the same routing. The routing's confidence
bound, step by step."""
import contextlib

import pytest
import torch

from dancegrpo.algo.grpo import UpdateBatch
from jagg_patch import interpolation_weights, make_policy_update
from jagg_patch.routing import AutoRouting, t_quantile

M, L, C, S, W = 2, 3, 4, 8, 3
T_SWITCH = 0.6   # above: affine field; below: a tanh network on top
STEPS = list(range(2 * W))   # each sample trains transitions 0..5: groups {0, 1, 2} (high noise), {3, 4, 5}


class SwitchedField(torch.nn.Module):
    """v = A z + b t + c, plus for t < T_SWITCH a tanh network of z times sin(40 t): dv/dtheta is affine
    in (z, t) above T_SWITCH and far from it below."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.A = torch.nn.Parameter(torch.randn(C, C, generator=g, dtype=torch.float64) * 0.5)
        self.b = torch.nn.Parameter(torch.randn(C, generator=g, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.randn(C, generator=g, dtype=torch.float64))
        self.W1 = torch.nn.Parameter(torch.randn(16, C, generator=g, dtype=torch.float64) * 3)
        self.W2 = torch.nn.Parameter(torch.randn(C, 16, generator=g, dtype=torch.float64))

    def forward(self, z, t):
        t = t.reshape(-1, 1, 1)
        affine = z @ self.A.T + t * self.b + self.c
        wave = (t < T_SWITCH).to(z.dtype) * torch.sin(40 * t)   # 0 above T_SWITCH; below, a fast oscillation in t
        return affine + wave * (torch.tanh(z @ self.W1.T) @ self.W2.T)


def _problem():
    """Timesteps, states and a PPO-like loss: over the first group the middle state lies on the segment
    between its neighbours at alpha (so JAGG is exact there); elsewhere the states are random."""
    g = torch.Generator().manual_seed(1)
    t = torch.linspace(0.95, 0.05, S, dtype=torch.float64)
    z = torch.randn(S, M, L, C, generator=g, dtype=torch.float64)
    alpha = interpolation_weights(t[:W])
    for j in range(1, W - 1):
        z[j] = (1 - alpha[j]) * z[0] + alpha[j] * z[W - 1]
    target = torch.randn(S, M, L, C, generator=g, dtype=torch.float64)
    adv = torch.randn(M, generator=g, dtype=torch.float64)
    assert bool((t[:W] > T_SWITCH).all()) and bool((t[W:2 * W] < T_SWITCH).all())
    return t, z, target, adv


def _batch(model, rows=None, step=1, advantage_scale=1.0):
    t, z, target, adv = _problem()
    adv = adv * advantage_scale
    rows = torch.arange(M) if rows is None else rows

    def predict(k):
        return model(z[k, rows], t[k])

    def step_loss(k, v):
        return (adv[rows] * ((target[k, rows] - v) ** 2).mean(dim=(1, 2))).sum()

    return UpdateBatch(predict=predict, step_loss=step_loss, steps=torch.tensor([STEPS] * len(rows)), timesteps=t,
                       subset=lambda r: _batch(model, rows[r], step, advantage_scale), step=step,
                       parameters=lambda: list(model.parameters()), counted_apart=contextlib.nullcontext,
                       predict_batched=lambda ks: [predict(k) for k in ks])


def _grads(model, update, batch):
    for p in model.parameters():
        p.grad = None
    stats = update(batch)
    return stats, [p.grad.clone() for p in model.parameters()]


def test_auto_routes_exactly_the_linear_position_and_trains_as_that_fixed_routing():
    model = SwitchedField()
    auto = make_policy_update(window=W, jagg_frac="auto", backward="split", monitor_every=5, monitor_samples=M, min_cos=0.8)
    stats, routed = _grads(model, auto, _batch(model))
    assert abs(stats.metrics["jagg_cos/g0"] - 1) < 1e-12 and stats.metrics["jagg_relerr/g0"] < 1e-10
    assert stats.metrics["jagg_cos/g1"] < 0.6   # measured 0.51: far below the threshold
    assert stats.metrics["jagg_routed"] == 0b01 and auto.routing.routed == {0}
    assert (stats.jagg_groups, stats.exact_groups) == (M, M)
    # The same routing by a fixed fraction: the first of the two positions (round_half_up(2 x 0.5) = 1).
    fixed_stats, fixed = _grads(model, make_policy_update(window=W, jagg_frac=0.5, backward="split"), _batch(model))
    assert all(torch.equal(a, b) for a, b in zip(routed, fixed)) and fixed_stats.loss == stats.loss
    # Before any measurement every position is exact: a step that is not measured after a fresh start.
    fresh = make_policy_update(window=W, jagg_frac="auto", backward="split", monitor_every=5, monitor_samples=M)
    unmeasured, _ = _grads(model, fresh, _batch(model, step=2))
    assert (unmeasured.jagg_groups, unmeasured.exact_groups, unmeasured.metrics) == (0, 2 * M, {"jagg_routed": 0})


def _bound_reference(measurements, min_cos, decay=0.5):
    """The routing written out: EMA of the means, variance of the EMA from each measurement's sd^2 / n,
    a one-sided 95% Student-t bound (scipy's quantile) for the latest n - 1; in when the lower bound
    reaches min_cos, out when the upper bound falls below it, else as before."""
    from scipy.stats import t as student
    routed, mean, var, seen = False, None, None, []
    for cos, sd, n in measurements:
        se2 = sd ** 2 / n
        mean, var = (cos, se2) if mean is None else (decay * mean + (1 - decay) * cos,
                                                     decay ** 2 * var + (1 - decay) ** 2 * se2)
        half = student.ppf(0.95, n - 1) * var ** 0.5
        routed = True if mean - half >= min_cos else False if mean + half < min_cos else routed
        seen.append(routed)
    return seen


def test_the_routing_moves_only_when_its_confidence_bound_clears_the_threshold():
    """A 2-sample mean of 0.9 with a wide spread does not route (the old rule, mean >= min_cos, did);
    a tight 0.9 does; a smoothed 0.8 whose bound straddles 0.8 keeps the routing; a bound below it
    leaves JAGG, and a mean just above 0.8 does not come back while its bound straddles the threshold."""
    measurements = [(0.9, 0.1, 2), (0.9, 0.01, 8), (0.7, 0.01, 8), (0.7, 0.01, 8), (0.81, 0.001, 8)]
    routing, seen = AutoRouting(min_cos=0.8), []
    for cos, sd, n in measurements:
        routing.update({"jagg_cos/g0": cos, "jagg_cos_sd/g0": sd, "jagg_cos_n/g0": n, "endpoints_cos/g0": 0.0})
        seen.append(0 in routing.routed)
    assert seen == _bound_reference(measurements, 0.8) == [False, True, True, False, False]
    assert routing.smoothed[0] == pytest.approx(0.78)


def test_one_sample_gives_no_bound_and_auto_refuses_it():
    routing = AutoRouting(min_cos=0.5)
    routing.update({"jagg_cos/g0": 0.99, "jagg_cos_sd/g0": 0.0, "jagg_cos_n/g0": 1})
    assert routing.routed == set()   # no spread, no bound: nothing is decided
    with pytest.raises(ValueError, match="monitor_samples >= 2"):
        make_policy_update(window=W, jagg_frac="auto", monitor_every=1, monitor_samples=1)


def test_the_t_quantiles_are_students():
    from scipy.stats import t as student
    for dof in range(1, 41):
        expected = student.ppf(0.95, dof) if dof <= 30 else 1.645
        assert t_quantile(dof) == pytest.approx(expected, abs=6e-4), dof


@pytest.mark.slow
def test_a_resumed_auto_run_routes_and_trains_as_the_unbroken_one(cache_dir, tmp_path, capsys):
    """Measured at steps 1 and 4 only, a checkpoint every 2 steps: a run resumed from checkpoint-2 routes
    step 3 by the routing its checkpoint saved (step 1's), as the unbroken run does, and ends on the same
    weights bit for bit; the saved routing state is that of the unbroken run at each checkpoint."""
    import json
    from safetensors.torch import load_file
    from helpers import FAST, run_main

    def run(out, steps, *extra):
        assert run_main("jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                        "--output_dir", tmp_path / out, *FAST, "--jagg_window", 3, "--jagg_frac", "auto",
                        "--jagg_monitor_every", 4, "--checkpointing_steps", 2, "--max_train_steps", steps, *extra) == 0

    run("unbroken", 4)
    run("resumed", 2)
    capsys.readouterr()
    run("resumed", 4, "--resume_from_checkpoint", "latest")
    assert "starts afresh" not in capsys.readouterr().out

    def records(out):
        with open(tmp_path / out / "metrics.jsonl") as f:
            return {r["step"]: r for r in map(json.loads, f)}
    unbroken, resumed = records("unbroken"), records("resumed")
    assert unbroken[3]["jagg_routed"] > 0 and unbroken[3]["jagg_groups"] > 0   # step 1's routing, kept
    assert [resumed[s]["jagg_routed"] for s in (3, 4)] == [unbroken[s]["jagg_routed"] for s in (3, 4)]
    assert [resumed[s]["jagg_groups"] for s in (3, 4)] == [unbroken[s]["jagg_groups"] for s in (3, 4)]
    name = "checkpoint-4-0/diffusion_pytorch_model.safetensors"
    a, b = load_file(str(tmp_path / "unbroken" / name)), load_file(str(tmp_path / "resumed" / name))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for step in (2, 4):
        saved = [torch.load(tmp_path / out / f"checkpoint-{step}-0" / "training_state.pt",
                            weights_only=False)["policy_update"] for out in ("unbroken", "resumed")]
        assert saved[0] == saved[1] and saved[0]["routing"]["routed"]


def test_a_routing_saved_on_other_groups_starts_afresh_and_measures_at_once(capsys):
    """A checkpoint's routing names positions of ITS groups: resumed with another window the positions
    are other groups, so the routing starts afresh and the first step measures (unscheduled); resumed
    with the same layout, it is restored and nothing is measured off schedule."""
    model = SwitchedField()
    saved = make_policy_update(window=W, jagg_frac="auto", backward="split", monitor_every=10, monitor_samples=M)
    _grads(model, saved, _batch(model))
    state = saved.state_dict()
    assert state["routing"]["routed"] == [0] and state["layout"] == {"window": W, "grouping": "trained",
                                                                       "trained": len(STEPS)}
    capsys.readouterr()
    same = make_policy_update(window=W, jagg_frac="auto", backward="split", monitor_every=10, monitor_samples=M)
    same.load_state_dict(state)
    stats, _ = _grads(model, same, _batch(model, step=3))
    assert stats.metrics == {"jagg_routed": 0b01} and (stats.jagg_groups, stats.exact_groups) == (M, M)
    other = make_policy_update(window=2, jagg_frac="auto", backward="split", monitor_every=10, monitor_samples=M)
    other.load_state_dict(state)
    stats, _ = _grads(model, other, _batch(model, step=3))
    said = capsys.readouterr().out
    assert "routing was measured on other groups (window 3 -> 2): it starts afresh" in said
    assert "jagg_cos/g0" in stats.metrics   # measured at step 3, off the every-10 schedule
    assert other.state_dict()["layout"]["window"] == 2
    # routed by its own measurement of W 2's groups, not by W 3's saved position 0
    assert other.routing.smoothed.keys() == {0, 1, 2}


def test_a_measurement_with_nothing_to_compare_says_so_and_keeps_the_routing(capsys):
    """All-zero advantages: no gradient, no cosine to log; one line says why, the routing stays."""
    model = SwitchedField()
    auto = make_policy_update(window=W, jagg_frac="auto", backward="split", monitor_every=1, monitor_samples=M, min_cos=0.8)
    _grads(model, auto, _batch(model))
    assert auto.routing.routed == {0}
    stats, _ = _grads(model, auto, _batch(model, step=2, advantage_scale=0.0))   # advantage 0 for every sample
    assert not any("_cos/" in k for k in stats.metrics) and stats.metrics["monitor_skipped"] == 1
    assert "step 2: the JAGG monitor measured nothing" in capsys.readouterr().out
    assert auto.routing.routed == {0} and stats.metrics["jagg_routed"] == 0b01


def test_the_agreement_study_routes_each_measurement_by_both_rules(cache_dir, tmp_path):
    """benchmarks/routing_agreement.py: disjoint sets of n samples within a rollout; the mean rule routes a
    spread-out 0.991 at 0.99, the bound does not; pairs counted by hand; a tiny end-to-end run."""
    from helpers import load_benchmark_script
    study = load_benchmark_script("routing_agreement")
    found = [(1, s, {0: c}) for s, c in enumerate([0.999, 0.983, 0.995, 0.9951])] + [(2, 0, {0: 0.98})]
    assert study.measurements(found, 2) == [[{0: 0.999}, {0: 0.983}], [{0: 0.995}, {0: 0.9951}]]
    assert study.routed_by_mean([{0: 0.999}, {0: 0.983}], 0.99) == {0}
    assert study.routed_by_bound([{0: 0.999}, {0: 0.983}], 0.99) == set()
    assert study.routed_by_bound([{0: 0.995}, {0: 0.9951}], 0.99) == {0}
    assert study.agreement([{0}, {0}, set()]) == pytest.approx(1 / 3)
    result = study.main(["--family", "flux", "--preset", "tiny", "--cache_dir", cache_dir, "--out", str(tmp_path),
                         "--windows", "4", "--min_cos", "0.5", "--rollouts", "1", "--samples", "4", "--sizes", "2,4"])
    (table,) = result["tables"]
    assert [row["n"] for row in table["rows"]] == [2, 4] and table["rows"][0]["measurements"] == 2
    assert len(table["cosines"]) == 4 and (tmp_path / "agreement.md").is_file()
