"""The loop reaches the engine only through dancegrpo.engines.base.Engine: an engine registered in
ENGINES is chosen by --engine and called for every backward, optimizer step and checkpoint."""
import ast
import os

import torch

from dancegrpo import engines, train_grpo_flux
from dancegrpo.engines import FSDPEngine
from helpers import FAST, REPO_ROOT


class Recording(FSDPEngine):
    """The default engine, with its own backward, recording what the loop asks of it."""
    name = "recording"
    calls = []

    def backward(self, outputs, grads=None):
        self.calls.append("backward")
        torch.autograd.backward(outputs, grads)

    def optimizer_step(self, check_norm):
        self.calls.append("optimizer_step")
        return super().optimizer_step(check_norm)

    def full_state(self, trainable_only=False):
        self.calls.append("full_state")
        return super().full_state(trainable_only)

    def save_state(self, folder):
        self.calls.append("save_state")
        super().save_state(folder)

    def close(self):
        self.calls.append("close")
        super().close()


def test_a_registered_engine_is_the_only_way_the_loop_steps(make_args, monkeypatch, tmp_path):
    monkeypatch.setitem(engines.ENGINES, "recording", Recording)
    Recording.calls = []
    flags = [*FAST, "--max_train_steps", 1, "--checkpointing_steps", 1]
    plain = train_grpo_flux.main(make_args(*flags, "--output_dir", tmp_path / "plain"))[-1]
    recorded = train_grpo_flux.main(make_args(*flags, "--engine", "recording", "--output_dir", tmp_path / "rec"))[-1]
    assert Recording.calls.count("optimizer_step") == recorded["optimizer_steps"] == 1
    # vanilla: one backward per trained transition and micro-batch (FAST: micro-batches of 4 samples)
    assert Recording.calls.count("backward") == recorded["train_timesteps"] * recorded["samples"] // 4
    assert Recording.calls.count("save_state") == 1 and "full_state" in Recording.calls
    assert Recording.calls[-1] == "close" and Recording.calls.count("close") == 1   # once, at the end
    # The same gradient as the default engine's autograd backward: the same step, to the bit.
    assert (recorded["loss"], recorded["grad_norm"]) == (plain["loss"], plain["grad_norm"])


def test_nothing_outside_the_engines_asks_which_engine_it_has():
    """No `engine is None` / `engine is not None`, no test of --engine's value, outside engines/
    (and args.py, which only parses the flag)."""
    offenders = []
    root = os.path.join(REPO_ROOT, "dancegrpo")
    for folder, _, files in os.walk(root):
        if os.path.relpath(folder, root).startswith("engines"):
            continue
        for name in files:
            if not name.endswith(".py") or name == "args.py":
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Compare):
                    text = ast.unparse(node)
                    if "engine" in text and ("None" in text or "deepspeed" in text or "fsdp" in text):
                        offenders.append(f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno}: {text}")
    assert not offenders, offenders
