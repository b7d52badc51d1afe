"""The command lines answer --help and a flag error before torch, diffusers or the models load
(dancegrpo.utils.lazy, dancegrpo.entry): checked by what the process imported, not by a clock. And
the torch-free tables the parsers offer (dancegrpo.choices, jagg_patch.settings) are exactly what
the code behind them implements."""
import json
import subprocess
import sys

import pytest

from helpers import REPO_ROOT

HEAVY = ("torch", "diffusers", "transformers", "numpy", "safetensors", "peft", "deepspeed", "open_clip", "PIL")

# What the command line would be, after `python -m`.
COMMANDS = {
    "flux --help": ["dancegrpo.train_grpo_flux", "--help"],
    "qwenimage bad flag": ["dancegrpo.train_grpo_qwenimage", "--no_such_flag"],
    "flux_lora bad choice": ["dancegrpo.train_grpo_flux_lora", "--advantage", "none"],
    "jagg_patch --help": ["jagg_patch", "dancegrpo.train_grpo_flux", "--help"],
    "jagg_patch bad jagg flag": ["jagg_patch", "dancegrpo.train_grpo_flux", "--jagg_window", "1"],
    "upstream --help": ["jagg_patch.upstream", "--help"],
    "upstream no trainer file": ["jagg_patch.upstream", "--jagg_window", "4"],
    "evaluate --help": ["dancegrpo.evaluate", "--help"],
    "evaluate bad flag": ["dancegrpo.evaluate", "--no_such_flag"],
    "compare --help": ["jagg_patch.tools.compare", "--help"],
    "tradeoff bad flag": ["jagg_patch.tools.tradeoff", "--no_such_flag"],
    "launch --help": ["dancegrpo.launch", "--help"],
    "preprocess flux --help": ["dancegrpo.preprocess.flux", "--help"],
    "preprocess qwenimage bad flag": ["dancegrpo.preprocess.qwenimage", "--no_such_flag"],
    "bench_update --help": ["jagg_patch.tools.bench_update", "dancegrpo.train_grpo_flux", "--help"],
    "diagnostics --help": ["jagg_patch.tools.diagnostics", "dancegrpo.train_grpo_flux", "--help"],
    "fidelity bad flag": ["jagg_patch.tools.fidelity", "dancegrpo.train_grpo_flux", "--no_such_flag"],
    "cost_model bad flag": ["jagg_patch.tools.cost_model", "--no_such_flag"],
    "cost_flowgrpo --help": ["jagg_patch.tools.cost_flowgrpo", "--help"],
    "deferred --help": ["jagg_patch.deferred", "--help"],
    "deferred bad jagg flag": ["jagg_patch.deferred", "--jagg_window", "1", "train.py"],
}

PROBE = """
import json, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as stop:
    code = stop.code if isinstance(stop.code, int) else 1
print(json.dumps({"code": code, "loaded": sorted(m for m in %r if m in sys.modules)}), file=sys.stderr)
""" % (HEAVY,)


def probe(argv):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_and_flag_errors_answer_before_torch_loads(name):
    result = probe(COMMANDS[name])
    assert result["code"] == (0 if name.endswith("--help") else 2), result
    assert result["loaded"] == [], f"{name} imported {result['loaded']} before answering"


# An abbreviation of a flag (argparse's default accepts them) and a typo beside a missing required flag.
REFUSED = {
    "trainer": ["dancegrpo.train_grpo_flux", "--max_train_st", "3"],
    "jagg_patch": ["jagg_patch", "dancegrpo.train_grpo_flux", "--jagg_win", "8"],
    "evaluate typo, no --output_dir": ["dancegrpo.evaluate", "--no_such_flag"],
    "evaluate": ["dancegrpo.evaluate", "--output_d", "x"],
    "compare": ["jagg_patch.tools.compare", "run", "--label", "a"],
    "tradeoff": ["jagg_patch.tools.tradeoff", "--metr", "jpeg"],
    "quality_report": ["jagg_patch.tools.quality_report", "x", "--metr", "jpeg"],
    "cost_model": ["jagg_patch.tools.cost_model", "--he"],
    "preprocess": ["dancegrpo.preprocess.flux", "--output_d", "x"],
    "digits build": ["dancegrpo.digits.build", "--ou", "x"],
    "bench_update": ["jagg_patch.tools.bench_update", "dancegrpo.train_grpo_flux", "--bench_mod", "vanilla"],
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_an_abbreviated_or_unknown_flag_is_named_in_one_line(name, capsys):
    """No command takes an abbreviation for a flag (a later flag of that prefix would change what the
    command means); the unknown flag is named, not a missing --output_dir, in one line and a hint."""
    from helpers import run_main
    argv = REFUSED[name]
    assert run_main(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    unknown = next(a for a in argv[1:] if a.startswith("--"))
    assert len(err) == 2 and f"unrecognized arguments: {unknown}" in err[0] and "--help` lists" in err[1], err


def test_the_parsers_choices_are_what_the_code_implements():
    from dancegrpo import choices
    from dancegrpo.algo.advantages import ADVANTAGES
    from dancegrpo.algo.kernels import KERNELS
    from dancegrpo.engines import ENGINES, engine_class
    from dancegrpo.utils import fsdp_util, precision
    assert tuple(KERNELS) == choices.SDE_TYPES and tuple(ADVANTAGES) == choices.ADVANTAGE_RULES
    assert precision.CHOICES == choices.PRECISIONS and set(precision._DTYPES) | {"no"} == set(choices.PRECISIONS)
    assert fsdp_util.SHARDING_STRATEGIES == choices.SHARDING_STRATEGIES
    assert all(engine_class(name).name == name for name in ENGINES)


def test_a_trainer_modules_seams_load_on_first_use_and_a_patch_set_before_stays():
    code = """
import sys
import dancegrpo.train_grpo_qwenimage as m
assert "torch" not in sys.modules
marker = lambda batch: None
m.policy_update = marker            # as jagg_patch replaces a seam
assert m.main and "torch" in sys.modules and m.policy_update is marker
assert m.FAMILY.__name__ == "QwenImageFamily" and m.select_train_steps.__name__ == "select_train_steps"
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


class Writes:
    """A stderr that keeps each write() apart, as the file descriptor sees them (stderr writes through)."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return len(text)

    def flush(self):
        pass


@pytest.mark.parametrize("argv", [
    ["jagg_patch", "json"],
    ["jagg_patch.upstream", "--jagg_windw", "4", "x.py"],
    ["dancegrpo.preprocess", "--family", "nope"],
    ["dancegrpo.train_grpo_flux", "--preset", "tiny", "--output_dir", "{tmp}/file/out", "--max_train_steps", "1"]],
    ids=["cli-fail", "upstream-fail", "preprocess", "trainer-config-error"])
def test_an_error_line_is_one_write(argv, tmp_path, monkeypatch, cache_dir):
    """print() writes a line and its newline apart; two ranks' errors then glued on one line. Each line
    said is one write of the line and its newline."""
    from helpers import run_main
    (tmp_path / "file").write_text("x")
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    argv = [a.format(tmp=tmp_path) for a in argv] + (["--cache_dir", cache_dir] if "--preset" in argv else [])
    assert run_main(*argv) == 2
    said = [w for w in stderr.writes if w.startswith("error")]
    assert said and all(w.endswith("\n") and w.count("\n") == 1 for w in said), stderr.writes
    assert "\n" not in stderr.writes, stderr.writes
