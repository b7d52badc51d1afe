"""The Flow-GRPO stand-in (tests/flowgrpo_standin: a checkout of Flow-GRPO's layout, its flow_grpo package
put on sys.path as an installed one) run the ways the tests need, in this process (one process, or one
rank of a torchrun launch): as it is, with its model calls recorded, or through `python -m
jagg_patch.deferred`'s main; the gradient of the trainable parameters kept at every real optimizer step.
The learning rate is 0, so every step's gradient is at the same weights; lora_B is drawn away from its
zero initialisation at prepare (else the KL term is 0 and lora_A gets no gradient at all)."""
import contextlib
import os
import sys

import torch
from helpers import REPO_ROOT
from prepare_hooks import at_prepare, fresh_absl_flags

ROOT = os.path.join(REPO_ROOT, "tests", "flowgrpo_standin")
SCRIPT = os.path.join(ROOT, "scripts", "train_sd3.py")
CONFIG = os.path.join(ROOT, "config", "grpo.py") + ":tiny_sd3"
BATCH, TRAINED, GA = 2, 5, 2   # tiny_sd3's train.batch_size, int(6 steps * 0.99), batches per optimizer step
STEPS = 6
# every run: lr 0, checkpoints and logs in the folder given, one epoch (the stand-in stops at the top of epoch 1)
FIXED = ["--config.train.learning_rate=0.0"]


@contextlib.contextmanager
def checkout_on_path():
    """The stand-in checkout's flow_grpo package importable while a run lasts, as `pip install -e .` makes
    upstream's (its config/ and scripts/ folders are not left on sys.path for the tests after it)."""
    saved = list(sys.path)
    sys.path.insert(0, ROOT)
    try:
        yield
    finally:
        sys.path[:] = saved


def load_script():
    """scripts/train_sd3.py's definitions in a namespace of their own (its main block not run); its
    imports need the checkout on sys.path."""
    with open(SCRIPT) as f:
        code = compile(f.read(), SCRIPT, "exec")
    namespace = {"__name__": "train_sd3", "__file__": SCRIPT}
    exec(code, namespace)
    return namespace


def perturb_lora(model, seed=5):
    """lora_B away from zero (peft's init), the same on every rank and every run."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.05)


@contextlib.contextmanager
def stopping_after(epochs):
    saved = os.environ.get("FLOWGRPO_STANDIN_EPOCHS")
    os.environ["FLOWGRPO_STANDIN_EPOCHS"] = str(epochs)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["FLOWGRPO_STANDIN_EPOCHS"]
        else:
            os.environ["FLOWGRPO_STANDIN_EPOCHS"] = saved


def script_flags(flags, save_dir, config=CONFIG):
    return ["--config", config, *FIXED, f"--config.save_dir={save_dir}", *map(str, flags)]


def exits_cleanly(run):
    """absl's app.run and the stand-in's stop both end in SystemExit; 0 / None is a clean end."""
    try:
        run()
    except SystemExit as done:
        assert done.code in (None, 0), done.code
        return
    raise AssertionError("the stand-in returned without its stop")


def run_plain(flags, save_dir, replace=None, record=None, config=CONFIG):
    """The stand-in as it is: (its gradients at each optimizer step, the prepared models, their grad-mode
    forwards). `record`, a list,
    gets every grad-mode compute_log_prob's (sample, j, embeds, pooled_embeds)."""
    fresh_absl_flags()
    with checkout_on_path():
        namespace = load_script()
    if record is not None:
        own = namespace["compute_log_prob"]

        def compute_log_prob(transformer, pipeline, sample, j, embeds, pooled_embeds, config):
            if torch.is_grad_enabled():
                record.append((sample, j, embeds, pooled_embeds))
            return own(transformer, pipeline, sample, j, embeds, pooled_embeds, config)
        namespace["compute_log_prob"] = compute_log_prob
    from absl import app
    saved = sys.argv
    sys.argv = [SCRIPT, *script_flags(flags, save_dir, config)]
    try:
        with stopping_after(1), at_prepare(replace, before=perturb_lora) as (grads, models, grad_forwards):
            exits_cleanly(lambda: app.run(namespace["main"]))
    finally:
        sys.argv = saved
    return grads, models, len(grad_forwards)


def run_launcher(jagg_flags, flags, save_dir, metrics_dir=None, config=CONFIG):
    """`python -m jagg_patch.deferred [jagg flags] SCRIPT -- [its flags]` in this process: (its gradients at
    each optimizer step, the prepared model's grad-mode forwards)."""
    fresh_absl_flags()
    from jagg_patch.deferred.__main__ import main
    argv = [*map(str, jagg_flags), "--jagg_metrics_dir", str(metrics_dir or save_dir), SCRIPT, "--",
            *script_flags(flags, save_dir, config)]
    with checkout_on_path(), stopping_after(1), at_prepare(before=perturb_lora) as (grads, _, grad_forwards):
        exits_cleanly(lambda: main(argv))
    return grads, len(grad_forwards)


def run_case(flags, jagg_flags, jagg_config, workdir):
    """One setting, in this process (one process, or one rank): the stand-in as it is, recorded, and
    through the launcher; the references from the recorded calls (tests/flowgrpo_reference.py, this
    rank's rows: under DDP the ranks' references are averaged by the caller). `jagg_config` holds the
    reference's window, jagg_frac, mode and alpha, as `jagg_flags` set them. Returns a dict of tensors
    and counts."""
    import types

    from absl import flags as absl_flags
    from deferred_loops import SignalRecorder, jagg_reference
    from flowgrpo_reference import labels_of, scheduler_sigmas, sd3_row, signal_of
    from helpers import relative_error
    plain, _, plain_forwards = run_plain(flags, os.path.join(workdir, "plain"))
    records, recorders = [], []

    def recorder(model):
        inner = getattr(model, "module", model)   # under DDP: the forward past DDP, whose reducer waits for a backward
        recorders.append(SignalRecorder(inner))
        if inner is not model:
            recorders[-1].module = inner
        return recorders[-1]

    _, models, _ = run_plain(flags, os.path.join(workdir, "recorded"), replace=recorder, record=records)
    config = absl_flags.FLAGS.config
    c = types.SimpleNamespace(cfg=config.train.cfg, guidance=config.sample.guidance_scale,
                              noise_level=config.sample.noise_level, adv_clip_max=config.train.adv_clip_max,
                              clip_range=config.train.clip_range, beta=config.train.beta)
    model = getattr(models[0], "module", models[0])
    calls = recorders[0].calls
    timesteps, sigmas = scheduler_sigmas(config.sample.num_steps)
    signals = [signal_of(model, r, c, GA * TRAINED, timesteps, sigmas) for r in records]
    own = [(args, kwargs, _leaf_with(leaf, s)) for (args, kwargs, leaf), s in zip(calls, signals)]
    labels = labels_of(records, c.cfg)
    steps = [GA * TRAINED * (i + 1) for i in range(len(plain))]

    def never(label):   # every sample its own noise: no two rollout rows alike
        return False
    exact = types.SimpleNamespace(mode="exact", window=1, jagg_frac=0.0, alpha="timestep")
    jagg, jagg_forwards = run_launcher(jagg_flags, flags, os.path.join(workdir, "jagg"))
    return {"plain": plain, "jagg": jagg, "plain_forwards": plain_forwards, "jagg_forwards": jagg_forwards,
            "signal_error": max(relative_error(leaf.grad, s) for (_, _, leaf), s in zip(calls, signals)),
            "ref_vanilla": jagg_reference(model, calls, labels, steps, exact, never, sd3_row),
            "ref_vanilla_own_signals": jagg_reference(model, own, labels, steps, exact, never, sd3_row),
            "ref_jagg": jagg_reference(model, calls, labels, steps, jagg_config, never, sd3_row),
            "ref_jagg_own_signals": jagg_reference(model, own, labels, steps, jagg_config, never, sd3_row)}


def _leaf_with(leaf, signal):
    """A leaf like `leaf` whose .grad is `signal` (what jagg_reference reads)."""
    out = leaf.detach().clone()
    out.grad = signal.to(out.dtype)
    return out


@contextlib.contextmanager
def with_grad_scaler(init_scale=2.0 ** 10):
    """accelerate as it runs fp16 on a GPU, on this CPU: its Accelerator(mixed_precision="fp16") turns
    fp16 off without a GPU (no scaler); here it gets a CPU GradScaler, so accelerator.backward scales the
    loss, accelerate's clip unscales first and its optimizer steps through the scaler. Yields the
    scalers made. accelerate's state holds one precision per process: it is reset on the way in and out."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    original, scalers = Accelerator.__init__, []

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.mixed_precision == "fp16":
            self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
            self.native_amp = True
            scalers.append(self.scaler)

    Accelerator.__init__ = __init__
    AcceleratorState._reset_state()
    try:
        yield scalers
    finally:
        Accelerator.__init__ = original
        AcceleratorState._reset_state()
