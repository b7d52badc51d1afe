"""What an evaluation reads before it runs, each checked with one line naming the fix: the
checkpoints named on the command line (labels, folders), the prompt file, and the preset each
checkpoint's run trained on. Shared by dancegrpo.evaluate (the command line) and
dancegrpo.eval_run (the evaluation)."""
import json
import os
import re

from .errors import ConfigError
from .run.run_config import CONFIG_NAME


class EvalError(ConfigError):
    """Bad input; the message names the fix."""


def parse_checkpoints(specs, base, preset):
    if not specs:
        if not base:
            raise EvalError("Nothing to evaluate: pass --checkpoint [LABEL=]PATH or --pretrained_model_name_or_path")
        return [(f"preset-{preset}" if preset else "base", base)]
    out = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or os.path.exists(spec):
            label, path = os.path.basename(os.path.normpath(spec)) or "checkpoint", spec
        out.append((label, path))
    labels = [lab for lab, _ in out]
    if len(set(labels)) != len(labels):
        raise EvalError(f"Checkpoint labels repeat ({labels}); name them with --checkpoint LABEL=PATH")
    return out


def safe_name(label):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "checkpoint"


# ------------------------------------------------------------------ prompts
def read_prompt_file(path):
    if not os.path.isfile(path):
        raise EvalError(f"--prompt_file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise EvalError(f"--prompt_file {path!r} holds no prompts (one prompt per line; blank lines are skipped)")
    return prompts


def preset_mismatch(label, path, preset):
    """One line when the checkpoint's run (its run_config.json) trained on another preset than the one
    evaluated with: the prompts, geometry and reward then are not the ones it learned; None otherwise."""
    try:
        with open(os.path.join(path, CONFIG_NAME)) as f:
            trained = json.load(f).get("preset")
    except (OSError, ValueError):
        return None   # not a trainer checkpoint (a base model, an upstream checkpoint): nothing recorded
    if trained == preset:
        return None
    said = lambda name: f"--preset {name}" if name else "no preset"   # noqa: E731
    return (f"{label}: trained with {said(trained)} ({CONFIG_NAME}), evaluated with {said(preset)}: its prompts, "
            "geometry and reward may not be the ones it learned")
