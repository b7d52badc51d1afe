"""jagg_patch.deferred on GRPO loops left as they are (tests/deferred_loops.py: DanceGRPO's Flux
trainer, its SD trainer, Flow-GRPO's SD3 trainer), float64: the gradient at every optimizer step
equals the JAGG gradient computed from the loop's own row labels by plain autograd, and
--jagg_mode exact equals the loop without the proxy."""
import pytest
import torch

from deferred_loops import (DT, LOOPS, Log, Setting, SignalRecorder, Velocity, capture_grads, gaussian_step,
                            jagg_reference, ppo, reference_gradients, velocity_row)
from helpers import relative_error
from jagg_patch import JaggConfig
from jagg_patch import deferred


def run(loop, setting, config, seed=0, lr=0.0, model=None, through_proxy=True, attach=True):
    """(gradients at each optimizer step, the proxy) of `loop` calling the model through the proxy."""
    model = model or Velocity()
    proxy = deferred.wrap(model, config) if through_proxy else model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if through_proxy and attach:
        proxy.attach(optimizer)
    log = Log()
    capture_grads(optimizer, [p for p in model.parameters() if p.requires_grad], log)
    try:
        LOOPS[loop](proxy, optimizer, setting, log, torch.Generator().manual_seed(seed))
    finally:
        if through_proxy:
            proxy.close()
    return log.grads, proxy


def assert_equal_steps(got, ref, bound=1e-12):
    assert len(got) == len(ref) and got
    errors = [relative_error(a, b) for a, b in zip(got, ref)]
    assert max(errors) < bound, errors


CONFIGS = {
    "w4-frac1": JaggConfig(window=4, jagg_frac=1.0, reuse="off"),
    "w3-frac0.6-index": JaggConfig(window=3, jagg_frac=0.6, alpha="index"),
    "w2": JaggConfig(window=2, jagg_frac=1.0),
    "w8-reuse": JaggConfig(window=8, jagg_frac=1.0, reuse="on_policy"),
    "endpoints": JaggConfig(window=4, jagg_frac=1.0, mode="endpoints"),
}


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deferred_equals_the_jagg_reference(loop, name):
    config = CONFIGS[name]
    setting = Setting(trained=6 if config.window == 8 else 4)
    got, proxy = run(loop, setting, config)
    assert_equal_steps(got, reference_gradients(Velocity(), loop, setting, config, 0))
    stats = proxy.stats[-1]
    assert stats.rows_deferred == setting.samples * setting.trained * (1 if loop == "flux" else 2)
    assert stats.exact_rows == stats.rows_exact.get("routed exact", 0)   # every row placed


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_exact_mode_is_the_loop_itself(loop):
    setting = Setting(accumulation=2, prompts=3)
    got, proxy = run(loop, setting, JaggConfig(mode="exact"))
    plain, _ = run(loop, setting, JaggConfig(), through_proxy=False)
    assert_equal_steps(got, plain, 1e-13)
    assert sum(s.rows_exact["mode exact"] for s in proxy.stats) == sum(s.rows_deferred for s in proxy.stats)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_several_optimizer_steps_and_reuse_before_the_first_only(loop):
    setting = Setting(accumulation=2, prompts=3)
    config = JaggConfig(window=4, jagg_frac=1.0, reuse="on_policy")
    got, proxy = run(loop, setting, config)
    assert_equal_steps(got, reference_gradients(Velocity(), loop, setting, config, 0))
    reused = [s.forwards_reused for s in proxy.stats]
    assert reused[0] > 0 and reused[1:] == [0] * (len(reused) - 1)   # stale after the first step
    assert [s.forwards_reused + s.forwards_nograd for s in proxy.stats] == [s.rows_deferred for s in proxy.stats]


def test_counts_per_group():
    """W 4, every group JAGG, reuse: per sample 0 call-time forwards, 2 replayed rows, their backwards."""
    setting = Setting()
    config = JaggConfig(window=4, jagg_frac=1.0, reuse="on_policy")
    _, proxy = run("flux", setting, config)
    s = proxy.stats[0]
    n = setting.samples
    assert (s.calls, s.rows_deferred, s.jagg_groups, s.endpoint_rows) == (4 * n, 4 * n, n, 2 * n)
    # the first call's output form is learned from its own forward (the rollout's calls have another form)
    assert (s.forwards_reused, s.forwards_nograd) == (4 * n, 0)
    assert s.forwards_grad == 2 * n and s.backward_calls == 2 * n   # chunks no larger than the loop's calls (1 row)
    assert s.rollout_rows == n * setting.steps and s.max_replay_diff == 0.0


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_the_batched_form_replays_twice_the_calls_rows_at_once(loop):
    """--jagg_backward batched: chunks of twice the loop's call rows (the restated batched form's
    peak), half the replay backwards, the same rows and the same gradient; split stays at the calls'."""
    setting = Setting(batch=2)
    got = {}
    for backward in ("split", "batched"):
        config = JaggConfig(window=4, jagg_frac=1.0, backward=backward)
        got[backward], proxy = run(loop, setting, config)
        s = proxy.stats[0]
        call_rows, rest = divmod(s.rows_deferred, s.calls)   # every call of these loops has as many rows
        assert rest == 0 and s.forwards_grad > 2 * call_rows
        assert s.backward_calls == -(-s.forwards_grad // (call_rows * (2 if backward == "batched" else 1)))
        assert_equal_steps(got[backward], reference_gradients(Velocity(), loop, setting, config, 0))


def first_step(label):
    return label[2] == 0


def test_identical_rows_are_placed_by_the_flushs_counts():
    """DanceGRPO SD: every sample starts from one latent, so a prompt's first-step conditional rows are
    one rollout row, and every sample's unconditional one; every sample trains as many steps, so the
    samples a row short own them: the gradient is the reference's that groups each with its sample,
    not the one that trains them apart."""
    setting = Setting(shared_noise=True)
    config = JaggConfig(window=4, jagg_frac=1.0)
    got, proxy = run("sd", setting, config)
    assert_equal_steps(got, reference_gradients(Velocity(), "sd", setting, config, 0))
    assert proxy.stats[0].shared_placed > 0 and proxy.stats[0].exact_rows == 0
    apart = reference_gradients(Velocity(), "sd", setting, config, 0, identical=first_step)
    assert relative_error(got[0], apart[0]) > 1e-3


def uneven_loop(model, optimizer, log, generator):
    """Three samples of one prompt from one latent that train different numbers of steps (no loop this
    package reaches trains so): the flush's counts leave the owners of the shared first step to a guess."""
    s = Setting(prompts=1, generations=3, steps=5)
    sigmas, (cond, _) = s.sigmas(), s.embeddings()
    traj = [torch.randn(1, s.tokens, s.channels, generator=generator, dtype=DT).expand(3, -1, -1).clone()]
    old = []
    with torch.no_grad():
        for k in range(s.steps):
            v = model(hidden_states=traj[k], timestep=sigmas[k].expand(3), encoder_hidden_states=cond,
                      return_dict=False)[0]
            nxt, lp = gaussian_step(traj[k], v, float(sigmas[k]), float(sigmas[k + 1]), s.eta, generator=generator)
            traj.append(nxt)
            old.append(lp - 0.05)
    advantages = torch.tensor([1.0, -0.5, 0.3], dtype=DT)
    for i, steps in enumerate(([0, 1, 2], [0, 3], [1, 2, 3, 4])):
        for k in steps:
            log.calls.append([(i, 0, k)])
            v = model(hidden_states=traj[k][i:i + 1], timestep=sigmas[k].expand(1), encoder_hidden_states=cond[i:i + 1],
                      return_dict=False)[0]
            _, logp = gaussian_step(traj[k][i:i + 1], v, float(sigmas[k]), float(sigmas[k + 1]), s.eta,
                                    prev=traj[k + 1][i:i + 1])
            (ppo(logp, old[k][i], advantages[i], s).mean() / 9).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_identical_rows_the_counts_cannot_place_train_exactly_in_one_replay():
    """Where the owners would be a guess the shared rows train exactly: the gradient is the reference's
    that trains them apart, and the two rows of one input are one replayed row (their signals summed)."""
    config = JaggConfig(window=4, jagg_frac=1.0)
    model = Velocity()
    proxy = deferred.wrap(model, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    log = Log()
    capture_grads(optimizer, list(model.parameters()), log)
    uneven_loop(proxy, optimizer, log, torch.Generator().manual_seed(0))
    proxy.close()
    recorder, labels = SignalRecorder(Velocity()), Log()
    reference = torch.optim.SGD(recorder.model.parameters(), lr=0.0)
    uneven_loop(recorder, reference, labels, torch.Generator().manual_seed(0))
    ref = jagg_reference(recorder.model, recorder.calls, labels.calls, [len(recorder.calls)], config, first_step,
                         velocity_row)
    assert relative_error(log.grads[0], ref[0]) < 1e-12
    stats = proxy.stats[0]
    assert stats.shared_placed == 0 and stats.rows_exact == {"identical rows": 2, "routed exact": 1}
    # sample 0: [1, 2] one group (2 endpoints); sample 1: [3] exact; sample 2: one group (2); the shared rows: 1
    assert stats.forwards_grad + stats.zero_rows == 6


def test_a_re_evaluation_of_the_rollouts_rows_is_not_a_rollout():
    """The rollout's rows evaluated again without grad before the update (old log-probs recomputed): a
    chain of known rows alone is left out of the record, so no row becomes ambiguous."""
    setting = Setting(reevaluate=True)
    config = JaggConfig(window=4, jagg_frac=1.0)
    got, proxy = run("flux", setting, config)
    assert_equal_steps(got, reference_gradients(Velocity(), "flux", setting, config, 0))
    assert proxy.stats[0].exact_rows == 0


def test_kl_reference_calls_are_not_a_rollout():
    """Flow-GRPO's KL pass: disable_adapter() calls under no_grad between update calls, on rows the
    update holds: passed through, not recorded, and the gradient (KL term included) the reference's."""
    setting = Setting(kl_beta=0.5)
    config = JaggConfig(window=4, jagg_frac=1.0)
    got, proxy = run("flowgrpo", setting, config)
    assert_equal_steps(got, reference_gradients(Velocity(), "flowgrpo", setting, config, 0))
    assert proxy.stats[0].rollout_rows == 2 * setting.samples * setting.steps
    assert proxy.stats[0].zero_rows > 0   # the detached uncond half is not replayed


def rollout_elsewhere(proxy, sampler):
    """The loop's model: its calls in grad mode through the proxy, those without grad on `sampler`."""
    class Split:
        def __call__(self, *a, **k):
            return proxy(*a, **k) if torch.is_grad_enabled() else sampler(*a, **k)

        def __getattr__(self, name):
            return getattr(proxy, name)
    return Split()


def run_split(setting, config, sampler_of):
    model = Velocity()
    proxy = deferred.wrap(model, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    proxy.attach(optimizer)
    log = Log()
    capture_grads(optimizer, list(model.parameters()), log)
    LOOPS["flux"](rollout_elsewhere(proxy, sampler_of(model)), optimizer, setting, log,
                  torch.Generator().manual_seed(0))
    proxy.close()
    return log.grads, proxy


def test_a_rollout_on_the_model_inside_is_seen():
    """The rollout calls the model itself, past the proxy (as pipeline.unet while the update calls the
    prepared wrapper): the forward hook records it, and the update is grouped as usual."""
    setting, config = Setting(), JaggConfig(window=4, jagg_frac=1.0)
    got, proxy = run_split(setting, config, lambda model: model)
    assert_equal_steps(got, reference_gradients(Velocity(), "flux", setting, config, 0))
    assert proxy.stats[0].rollout_rows == setting.samples * setting.steps and proxy.stats[0].exact_rows == 0


def test_a_rollout_the_proxy_did_not_see_trains_exactly():
    """The rollout on another object (a copy of the model): no row can be placed, each trains with its
    own forward and backward, and the gradient is vanilla's."""
    import copy
    setting = Setting()
    got, proxy = run_split(setting, JaggConfig(window=4, jagg_frac=1.0), copy.deepcopy)
    plain, _ = run("flux", setting, JaggConfig(), through_proxy=False)
    assert_equal_steps(got, plain, 1e-13)
    assert proxy.stats[0].rows_exact == {"no rollout record": setting.samples * setting.trained}


def test_interleaved_rollouts_are_never_linked_across():
    """Two batches of the same prompts sampled step by step in turn: each call could continue either
    chain, so none is continued; no row is grouped with another sample's."""
    from jagg_patch.deferred.calls import Call, CallShape
    from jagg_patch.deferred.record import RolloutRecord
    model = Velocity()
    shape = CallShape.of(model)
    record = RolloutRecord()
    g = torch.Generator().manual_seed(0)
    text = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)
    z = {name: torch.randn(2, 5, 4, generator=g, dtype=torch.float64) for name in "ab"}
    for k, t in enumerate([0.9, 0.7, 0.5]):
        for name in "ab":
            call = Call.bind(shape, (z[name], torch.tensor(t, dtype=torch.float64), text), {}, False)
            record.observe(call, None, set())
            z[name] = z[name] + 0.1
    trajectories = {}
    for entries in record.index.values():
        for e in entries:
            trajectories.setdefault(e.trajectory, []).append(e.position)
    assert all(len(p) == 1 for p in trajectories.values())   # every call its own chain: nothing to group


def test_zero_grad_drops_what_is_pending():
    """A loop that zeroes the gradient without stepping erases vanilla's accumulated gradient: the
    pending rows are dropped the same way."""
    model = Velocity()
    proxy = deferred.wrap(model, JaggConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    proxy.attach(optimizer)
    with torch.no_grad():
        proxy(hidden_states=torch.zeros(1, 5, 4, dtype=torch.float64), timestep=torch.ones(1, dtype=torch.float64),
              encoder_hidden_states=torch.zeros(1, 2, 3, dtype=torch.float64))
    out = proxy(hidden_states=torch.ones(1, 5, 4, dtype=torch.float64), timestep=torch.ones(1, dtype=torch.float64),
                encoder_hidden_states=torch.zeros(1, 2, 3, dtype=torch.float64)).sample
    out.sum().backward()
    optimizer.zero_grad()
    assert proxy.flush() is None and all(p.grad is None for p in model.parameters())
    proxy.close()


def test_a_trajectory_trained_twice_in_one_flush_trains_exactly():
    """A sample whose steps come twice in one accumulation (HunyuanVideo's best-of-n overlap): its rows
    cannot be cut into one sample's groups, so each trains with its own forward and backward; the
    gradient is the loop's own."""
    g = torch.Generator().manual_seed(0)
    model = Velocity()
    text = torch.randn(1, 2, 3, generator=g, dtype=torch.float64)
    t = torch.linspace(0.9, 0.2, 6, dtype=torch.float64)
    z = [torch.randn(1, 5, 4, generator=g, dtype=torch.float64)]
    for k in range(5):
        z.append(z[-1] + 0.1 * torch.randn(1, 5, 4, generator=g, dtype=torch.float64))

    def update(net):
        with torch.no_grad():   # the rollout
            for k in range(5):
                net(hidden_states=z[k], timestep=t[k:k + 1], encoder_hidden_states=text)
        for ks in ([0, 2, 3, 4], [1, 2, 4]):   # trained twice: positions 2 and 4 in both
            for k in ks:
                out = net(hidden_states=z[k], timestep=t[k:k + 1], encoder_hidden_states=text).sample
                (out * z[k + 1]).sum().backward()

    proxy = deferred.wrap(model, JaggConfig(window=3, jagg_frac=1.0))
    update(proxy)
    proxy.flush()
    proxy.close()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    update(model)
    plain = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert relative_error(got, plain) < 1e-13
    assert proxy.stats[0].rows_exact == {"trained twice": 7}
