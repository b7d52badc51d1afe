"""Helpers shared by the test modules (no test module imports another): the fast geometry, the
float64 setup and independent references of the update, and one training step with its gradients
read at the optimizer step."""
import json
import math
import os

import numpy as np
import torch

from dancegrpo import trainer
from dancegrpo.models.flux import FluxFamily
from dancegrpo.algo.rollout import predict_velocity
from dancegrpo.algo.objective import transition_log_prob

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# Small, fast geometry on the tiny models: 2 prompts x 4 generations, one optimizer step, micro-batches
# of 4: S 8, fraction 0.6 -> 4 trained transitions per sample.
FAST = ["--train_batch_size", 2, "--num_generations", 4, "--gradient_accumulation_steps", 8,
        "--sample_batch_size", 8, "--update_batch_size", 4]


def relative_error(got, ref):
    """|got - ref| / |ref| in float64, over one tensor, a list of tensors or a dict of tensors (ref's keys)."""
    if isinstance(ref, dict):
        got, ref = [got[k] for k in ref], list(ref.values())
    elif torch.is_tensor(ref):
        got, ref = [got], [ref]
    assert len(got) == len(ref)
    num = sum(float(((a.double() - b.double()) ** 2).sum()) for a, b in zip(got, ref)) ** 0.5
    den = sum(float((b.double() ** 2).sum()) for b in ref) ** 0.5
    assert den > 0, "the reference is zero: a relative error says nothing"
    return num / den


def load_benchmark_script(name):
    """benchmarks/<name>.py as a module (the scripts are not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_jsonl(path):
    """The records of a .jsonl file (metrics.jsonl, jagg_metrics.jsonl), in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(output_dir, name="metrics.jsonl"):
    return read_jsonl(os.path.join(output_dir, name))


def grads_of(model):
    """The gradients of the trainable parameters, cloned."""
    return [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


def captured_step(make_args, *argv):
    """One train_one_step of the Flux trainer module (through its seams, as patched at the time);
    the gradients are read at each optimizer step. Returns (record, [grads per optimizer step], ctx)."""
    import dancegrpo.train_grpo_flux as flux
    args = make_args(*FAST, *argv)
    ctx = trainer.setup(args, flux.FAMILY(args))
    grads = []
    ctx.optimizer.step = lambda *a, **k: grads.append(grads_of(ctx.raw_transformer))
    ctx.step = 1
    record = flux.train_one_step(ctx)
    ctx.counter.remove()
    return record, grads, ctx


def reference_velocity(model, z, t, cond, h, w):
    """Direct diffusers call, written independently of FluxFamily.predict."""
    rows, cols = h // 16, w // 16
    r, c = torch.meshgrid(torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64),
                          indexing="ij")
    img_ids = torch.stack([torch.zeros_like(r), r, c], dim=-1).reshape(-1, 3)
    out = model(hidden_states=z, encoder_hidden_states=cond["encoder_hidden_states"],
                pooled_projections=cond["pooled_prompt_embeds"], timestep=t, img_ids=img_ids,
                txt_ids=torch.zeros(cond["encoder_hidden_states"].shape[1], 3, dtype=torch.float64),
                guidance=torch.full((z.shape[0],), 3.5, dtype=torch.float64))
    return out.sample


def reference_log_prob(v, rollout, b, k, sigmas, args):
    """log p of sample b's stored transition k given its velocity v, as upstream's flux_step writes it."""
    s, s_next = float(sigmas[k]), float(sigmas[k + 1])
    z, z_next = rollout.latents[b:b + 1, k], rollout.latents[b:b + 1, k + 1]
    x0 = z - s * v
    mean = z + (s_next - s) * (v + 0.5 * args.eta ** 2 * (z - (1 - s) * x0) / s ** 2)
    std = args.eta * math.sqrt(s - s_next)
    return torch.distributions.Normal(mean, std).log_prob(z_next).mean()


def reference_step_loss(v, rollout, b, k, adv, sigmas, args):
    """The PPO-clip loss of sample b's transition k given its velocity v, as upstream writes it."""
    logp = reference_log_prob(v, rollout, b, k, sigmas, args)
    ratio = torch.exp(logp - rollout.log_probs[b, k])
    a = adv[b].clamp(-args.adv_clip_max, args.adv_clip_max)
    return torch.maximum(-a * ratio, -a * ratio.clamp(1 - args.clip_range, 1 + args.clip_range))


def reference_t(sigma):
    """upstream: int() of the float32 product sigma * 1000, over 1000"""
    return int(np.float32(sigma) * np.float32(1000)) / 1000


def reference_step_velocity(model, rollout, cond, b, k, sigmas, args):
    t = torch.tensor([reference_t(float(sigmas[k]))], dtype=torch.float64)
    return reference_velocity(model, rollout.latents[b:b + 1, k], t, {key: val[b:b + 1] for key, val in cond.items()},
                              args.h, args.w)


def reference_loss(model, rollout, cond, adv, steps, sigmas, args, normaliser):
    """sum over samples and trained transitions of the PPO-clip loss, as upstream writes it per step
    (-1 in `steps` marks no transition)."""
    total = 0.0
    for b in range(steps.shape[0]):
        for k in [k for k in steps[b].tolist() if k >= 0]:
            v = reference_step_velocity(model, rollout, cond, b, k, sigmas, args)
            total = total + reference_step_loss(v, rollout, b, k, adv, sigmas, args)
    return total / normaliser


def float64_setup(make_args, update_batch_size, *extra, shared_noise=False):
    """shared_noise: a prompt group's samples start from one latent (--init_same_noise)."""
    args = make_args(*FAST, "--clip_range", "0.05", "--update_batch_size", update_batch_size, *extra)
    ctx = trainer.setup(args, FluxFamily(args))
    ctx.transformer.double()
    cond, captions = trainer.expand_groups(args, next(ctx.loader))
    cond = {k: v.double() for k, v in cond.items()}
    g = torch.Generator().manual_seed(0)
    n, S = len(captions), args.sampling_steps
    latents = torch.randn(n, S + 1, 16, 64, generator=g, dtype=torch.float64)
    if shared_noise:
        group = args.num_generations
        latents[:, 0] = latents[::group, 0].repeat_interleave(group, dim=0)
    # Old log-probs spread around the new ones so that some ratios leave [1-eps, 1+eps] (clip active).
    with torch.no_grad():
        log_probs = torch.stack([transition_log_prob(
            ctx, predict_velocity(ctx, latents[:, k], ctx.timesteps[k].expand(n).double(), cond),
            latents[:, k], latents[:, k + 1], k) for k in range(S)], dim=1)
    log_probs = log_probs + 0.1 * torch.randn(n, S, generator=g, dtype=torch.float64)
    rollout = trainer.Rollout(latents, log_probs, [], torch.zeros(n))
    adv = torch.randn(n, generator=g, dtype=torch.float64) * 3
    return args, ctx, cond, rollout, adv


def keep_rollout_outputs(ctx, rollout, cond):
    """What a rollout that keeps its outputs stores: one forward over ALL samples per transition
    (the update then runs in other micro-batches)."""
    n = rollout.latents.shape[0]
    with torch.no_grad():
        rollout.outputs = torch.stack([predict_velocity(ctx, rollout.latents[:, k],
                                                                ctx.timesteps[k].expand(n).double(), cond)
                                       for k in range(rollout.latents.shape[1] - 1)], dim=1)


# ---------------------------------------------------------------- two-rank checks, one launch

def exit_threads_env(env, folder):
    """`env` for processes that record, at the very end of their exit, the native threads still alive
    (tests/exit_threads/sitecustomize.py), one file per process in `folder`."""
    os.makedirs(folder, exist_ok=True)
    path = os.pathsep.join(p for p in (os.path.join(TESTS_DIR, "exit_threads"), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "EXIT_THREADS_DIR": str(folder)}


def threads_at_exit(folder):
    """{pid: [thread names]} recorded by the processes started with exit_threads_env."""
    return {int(name[:-4]): open(os.path.join(folder, name)).read().split()
            for name in os.listdir(folder) if name.endswith(".txt")}


def gloo_threads_at_exit(folder):
    """The recorded processes that still ran one of gloo's threads at exit (a process group not
    released: the process can abort there), with those threads."""
    found = {pid: [t for t in names if "gloo" in t] for pid, names in threads_at_exit(folder).items()}
    return {pid: names for pid, names in found.items() if names}


def dist_check(name, check, flags=()):
    """A `dist_result` parameter: the named two-rank check (one of tests/dist/run_checks.py's
    CHECKS) with these flags. Use with `@pytest.mark.parametrize("dist_result", [...], indirect=True,
    ids=dist_id)`."""
    return name, check, tuple(str(f) for f in flags)


def dist_id(value):
    """The test id of a dist_check parameter: its name."""
    return value[0] if isinstance(value, tuple) else None


class DistChecks:
    """Runs every requested check in one `torchrun --nproc_per_node 2` launch, at the first
    result asked for, and hands each test its own."""

    def __init__(self, specs, cache_dir, out_dir):
        self.specs, self.cache_dir, self.out_dir = specs, cache_dir, out_dir
        self.proc = None

    def _launch(self):
        import json
        import subprocess
        import sys
        specs = self.out_dir / "specs.json"
        specs.write_text(json.dumps([dict(name=n, check=c, flags=list(f)) for n, c, f in self.specs]))
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               os.path.join(TESTS_DIR, "dist", "run_checks.py"), self.cache_dir, str(self.out_dir), str(specs)]
        self.proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=str(self.out_dir))

    def result(self, name):
        import json
        import pytest
        if self.proc is None:
            self._launch()
        path = self.out_dir / f"{name}.json"
        if not path.is_file():
            pytest.fail(f"two-rank check {name} wrote no result (launch exit {self.proc.returncode}):\n"
                        + self.proc.stdout[-3000:] + self.proc.stderr[-5000:])
        return json.loads(path.read_text())


# ---------------------------------------------------------------- a command line, in this process

def run_main(*argv):
    """`python -m ARGV...` in this process, through the module's own `__main__` block with sys.argv
    as the command line sets it; returns the exit status the process would have (SystemExit's code,
    0 when main returns). A process start costs ~10 s of imports on 2 CPU cores, a tiny run a second
    or two; tests of the process boundary itself (a signal, torchrun, an installed package) start
    real processes. A JAGG patch the launcher applied is reverted afterwards."""
    import runpy
    import sys
    import warnings
    from jagg_patch import revert_jagg
    module, *rest = [str(a) for a in argv]
    saved = sys.argv
    sys.argv = [module, *rest]
    try:
        with warnings.catch_warnings():   # "found in sys.modules ... prior to execution": as intended
            warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = saved
        revert_jagg()
    return 0


def run_mains(runs, folder, env=None):
    """Run {name: argv} one after another in ONE new process (tests/run_mains.py); returns {name:
    (exit status, stdout, stderr)}. A run that does not finish leaves no status (None)."""
    import json
    import subprocess
    import sys
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    logs = {name: os.path.join(folder, f"{name}.log") for name in runs}
    specs = os.path.join(folder, "runs.json")
    with open(specs, "w") as f:
        json.dump([dict(argv=[str(a) for a in argv], log=logs[name]) for name, argv in runs.items()], f)
    proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "run_mains.py"), specs], env=env,
                          capture_output=True, text=True, timeout=1200)

    def read(path):
        return open(path).read() if os.path.isfile(path) else None

    results = {}
    for name, log in logs.items():
        code = read(log + ".code")
        results[name] = (None if code is None else int(code), read(log + ".out") or "",
                         (read(log + ".err") or "") + ("" if code is not None else proc.stderr[-3000:]))
    return results


# ---------------------------------------------------------------- what a user's older environment lacks

def missing_diffusers_class(name):
    """Why a test that builds diffusers' `name` cannot run here (None: it can): an older diffusers
    (a user's environment) lacks it."""
    import diffusers
    try:
        getattr(diffusers, name)
        return None
    except (AttributeError, ImportError):
        return f"needs diffusers' {name}, which diffusers {diffusers.__version__} lacks"


def missing_cpu_fsdp2():
    """Why FSDP2 cannot run on this torch's CPU (None: it can): before torch.cpu.Stream had record_event
    (torch 2.6 lacks it), fully_shard's all-gather fails on a CPU stream."""
    if not hasattr(torch.cpu.Stream, "record_event"):
        return f"FSDP2 on CPU needs torch.cpu.Stream.record_event, which torch {torch.__version__} lacks"
    return None
