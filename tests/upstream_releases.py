"""Upstream's earlier releases as stand-ins: each is the 15cc71d stand-in checkout with the edits that
undo, in the functions the adapter relies on, what later releases changed (the references list the
changes). Releases that differ only in `main` (epoch count, a print, the wandb project name) have the
same stand-in as their neighbour; the stand-ins' `main` does not model those lines.

train_grpo_flux.py, newest first:
  9ac72b4 .. 15cc71d  the stand-in as it is
  2145e4f             flux_step's log-prob without its -log(std) - log(sqrt(2 pi)) terms (fixed in 9ac72b4)
  bbf5278             and train_one_step without ema_handler (added in 2145e4f)
  93ec253 .. 2af04bd  and ./hps_reward.txt with "hps reward" prints (renamed in bbf5278)

train_grpo_hunyuan.py (train_one_step unchanged since be8cf11):
  9ac72b4 .. 15cc71d  the stand-in as it is
  be8cf11, 0d761fa    flux_step's log-prob without its constant terms (as Flux before 9ac72b4)
(93ec253's HunyuanVideo trainer is another trainer, refused: not a release the adapter runs.)
"""
import os

from jagg_patch.seams import UPSTREAM_RELEASES, UpstreamRelease

from upstream_harness import copy_checkout, standin_file

_OLD_LOG_PROB = ('''def flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    return _dancegrpo_flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver)''',
                 '''def flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    # before 9ac72b4 a misplaced parenthesis dropped the log-density's -log(std) - log(sqrt(2 pi))
    z, pred_original, log_prob = _dancegrpo_flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo,
                                                      sde_solver)
    std = eta * torch.sqrt(sigmas[index] - sigmas[index + 1])
    return z, pred_original, log_prob + torch.log(std) + math.log(math.sqrt(2 * math.pi))''')
_MATH = ("import torch\n", "import math\n\nimport torch\n")
_NO_EMA = [("                   noise_scheduler, max_grad_norm, preprocess_val, ema_handler):",
            "                   noise_scheduler, max_grad_norm, preprocess_val):"),
           ("loader, None, args.max_grad_norm, None, None)", "loader, None, args.max_grad_norm, None)")]
_HPS = [('open("./reward.txt", "a")', 'open("./hps_reward.txt", "a")'),
        ('print("reward", sample["rewards"].item())', 'print("hps reward", sample["rewards"].item())')]

# (name, the trainer key, the commits it stands for, edits of the file) for every release of the three
# trainers that have older ones; the 15cc71d files are the stand-ins themselves.
RELEASES = (
    ("flux@9ac72b4", "flux", "9ac72b4 ff7bee1 15cc71d", []),
    ("flux@2145e4f", "flux", "2145e4f", [_MATH, _OLD_LOG_PROB]),
    ("flux@bbf5278", "flux", "bbf5278", [_MATH, _OLD_LOG_PROB, *_NO_EMA]),
    ("flux@93ec253", "flux", "93ec253 4790517 2af04bd", [_MATH, _OLD_LOG_PROB, *_NO_EMA, *_HPS]),
    ("flux_lora@ff7bee1", "flux_lora", "ff7bee1 15cc71d", []),
    ("qwenimage@9679174", "qwenimage", "9679174 6c014c9 15cc71d", []),
    ("qwenimage_edit@46f02b8", "qwenimage_edit", "46f02b8 6c014c9 15cc71d", []),
    ("wan@2d3371a", "wan", "2d3371a 15cc71d", []),
    ("hunyuan@9ac72b4", "hunyuan", "9ac72b4 ff7bee1 15cc71d", []),
    ("hunyuan@be8cf11", "hunyuan", "be8cf11 0d761fa", [_MATH, _OLD_LOG_PROB]),
    ("skyreels@61afbf2", "skyreels", "61afbf2 15cc71d", []),
)
# Which entry of jagg_patch.seams.UPSTREAM_RELEASES each stand-in release stands for.
RECORDED_AS = {"flux@9ac72b4": "ac4b353cdcc7f665", "flux@2145e4f": "ac4b353cdcc7f665",
               "flux@bbf5278": "289a6c265fedb7c7", "flux@93ec253": "c7a2fcac1dc57e74",
               "flux_lora@ff7bee1": "289a6c265fedb7c7", "qwenimage@9679174": "465f923956336644",
               "qwenimage_edit@46f02b8": "ff2ee0b57cf90003", "wan@2d3371a": "127e437113921902",
               "hunyuan@9ac72b4": "fae5119519022108", "hunyuan@be8cf11": "fae5119519022108",
               "skyreels@61afbf2": "f6253f76230e7ee4"}


def release(name):
    return next(r for r in RELEASES if r[0] == name)


def write_release(dest, name):
    """A plain checkout (not installed, not on any path) holding `name`'s trainer file; returns its path."""
    _, key, _, edits = release(name)
    path = standin_file(key, copy_checkout(dest))
    with open(path) as f:
        text = f.read()
    for old, new in edits:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)
    return path


def standin_releases(token_hashes):
    """jagg_patch.seams.UPSTREAM_RELEASES with each release's token hash replaced by its stand-in's:
    {stand-in release name: token hash} -> a table in which the stand-ins are the known releases."""
    by_real = {}
    for name, found in token_hashes.items():
        by_real.setdefault(RECORDED_AS[name], set()).add(found)
    table = []
    for real in UPSTREAM_RELEASES:
        (found,) = by_real[real.token_hash]   # one stand-in hash per recorded one, as the references group them
        table.append(UpstreamRelease(found, real.family, real.commits, real.parameters, real.reward_files))
    return tuple(table)


def release_folder(tmp_path, name):
    return os.path.join(str(tmp_path), name.replace("@", "_"))
