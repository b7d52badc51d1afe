"""`python -m jagg_patch` single-process and under torchrun, and FSDP1 joint backward."""
import json
import os
import subprocess
import sys

import pytest

import helpers
from helpers import REPO_ROOT

ROOT = REPO_ROOT
FAST = [str(a) for a in helpers.FAST]


def run(cmd, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]


def metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_help_explains_usage(capsys):
    assert helpers.run_main("jagg_patch", "--help") == 0
    out = capsys.readouterr().out
    assert "python -m jagg_patch TRAINER_MODULE" in out and "--jagg_window" in out


@pytest.mark.parametrize("flag, value, message", [
    ("--jagg_window", "1", "must be >= 2"), ("--jagg_frac", "1.5", "must be in [0, 1]"),
    ("--jagg_mode", "fast", "invalid choice"),
])
def test_bad_jagg_flags_are_argparse_errors(cache_dir, tmp_path, capsys, flag, value, message):
    from jagg_patch.__main__ import main   # the command line's own entry, in process (the CLI runs below)
    with pytest.raises(SystemExit) as exit_info:
        main(["dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
              str(tmp_path), flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and flag in err


def test_unknown_trainer_module_is_an_error(capsys):
    assert helpers.run_main("jagg_patch", "no_such.trainer") == 2
    assert "cannot import trainer module" in capsys.readouterr().err


def test_a_module_that_is_no_trainer_is_one_line(capsys):
    assert helpers.run_main("jagg_patch", "json") == 2
    err = capsys.readouterr().err
    assert "'json' is no trainer module (it has no build_parser); give one of dancegrpo.train_grpo_flux" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("tool", ["jagg_patch", "jagg_patch.upstream"])
def test_the_usage_lists_every_jagg_flag_with_the_parsers_default(tool, capsys):
    """The usage text is made from the parser: each --jagg_ flag, its values and its default."""
    import argparse
    from jagg_patch.cli import add_jagg_args
    assert helpers.run_main(tool, "--help") == 0
    usage = capsys.readouterr().out
    for action in add_jagg_args(argparse.ArgumentParser())._actions:
        flag = action.option_strings[-1]
        if not flag.startswith("--jagg_"):
            continue
        assert flag in usage, flag
        if action.choices:
            assert f"{flag} {'|'.join(action.choices)}" in usage, flag
        if action.default not in (None, False):
            assert f" ({action.default})" in usage.split(flag, 1)[1].split("--", 1)[0], flag


def test_launch_tiny_prints_plan_and_saves_backwards(cache_dir, tmp_path, capsys):
    """`python -m jagg_patch` (in this process: helpers.run_main; under torchrun below)."""
    assert helpers.run_main("jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                            "--output_dir", tmp_path, "--max_train_steps", "1", *FAST,
                            "--jagg_window", "3", "--jagg_frac", "0.6") == 0
    stdout = capsys.readouterr().out
    assert ("JAGG plan (grouping trained, alpha timestep, backward auto -> split, mode jagg, window 3, jagg_frac 0.6)"
            in stdout)
    assert "group 0: positions [0, 1, 2] (size 3) -> JAGG (jagg, split backward)" in stdout
    assert "per sample: 3 transformer backwards instead of 4" in stdout
    assert "group 1: positions [3] (size 1) -> exact" in stdout
    (record,) = metrics(tmp_path)
    assert (record["jagg_groups"], record["exact_groups"]) == (8, 8)
    assert record["transformer_backwards"] == 8 * (2 + 1)  # vanilla: 8 * 4


@pytest.mark.parametrize("dist_result", [helpers.dist_check("fsdp-jagg-core", "jagg_core")],
                         indirect=True, ids=helpers.dist_id)
def test_fsdp_joint_backward_equals_single_process(dist_result):
    """jagg_group_backward on FSDP1 (tests/dist/fsdp_jagg_check.py): on every rank, with and without
    activation checkpointing, the gradient equals the single-process one and a JAGG group costs ONE
    autograd.backward call (an exact group one per member)."""
    assert dist_result["world_size"] == 2
    for rank in dist_result["ranks"]:
        for setting in ("plain", "checkpointing"):
            got = rank[setting]
            assert got["rel_err"] < 1e-5 and got["same_names"], (setting, got)
            assert got["groups"][0] == [True, 1], got
            assert got["autograd_backward_calls"] == sum(1 if jagg else n for jagg, n in got["groups"]), got


@pytest.mark.slow
def test_launch_under_torchrun(cache_dir, tmp_path):
    out = run(torchrun("-m", "jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir",
                       cache_dir, "--output_dir", str(tmp_path), "--max_train_steps", "1", *FAST,
                       "--jagg_window", "4"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("JAGG plan") == 1  # printed by rank 0 only
    (record,) = metrics(tmp_path)
    assert record["world_size"] == 2 and record["samples"] == 16
    assert (record["jagg_groups"], record["transformer_backwards"]) == (16, 2 * 16)


# ---------------------------------------------------------------- the authors' variant flags

def test_window_larger_than_trajectory_stops_before_loading(cache_dir, tmp_path, capsys):
    from jagg_patch.__main__ import main
    with pytest.raises(SystemExit) as exit_info:
        main(["dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
              str(tmp_path), "--jagg_grouping", "window", "--jagg_window", "8"])   # tiny: S 8 -> 7 transitions
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "--jagg_window <= S-1 = 7" in err and "lower --jagg_window" in err
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


@pytest.mark.parametrize("flag, value", [("--jagg_grouping", "windows"), ("--jagg_alpha", "linear"),
                                         ("--jagg_backward", "both")])
def test_unknown_variant_flags_are_argparse_errors(cache_dir, tmp_path, capsys, flag, value):
    from jagg_patch.__main__ import main
    with pytest.raises(SystemExit) as exit_info:
        main(["dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
              str(tmp_path), flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "invalid choice" in err and flag in err


def test_window_plan_text(make_args):
    from jagg_patch.cli import add_jagg_args, jagg_plan_text
    from dancegrpo.args import parse_args
    import dancegrpo.train_grpo_qwenimage as tq
    parser = add_jagg_args(tq.build_parser())
    args = parse_args(parser, ["--preset", "tiny", "--output_dir", "x", "--sampling_steps", "21",
                               "--timestep_fraction", "0.6", "--jagg_window", "5", "--jagg_frac", "0.5",
                               "--jagg_grouping", "window", "--jagg_alpha", "index", "--jagg_backward", "split"])
    text = jagg_plan_text(args)
    assert "grouping window, alpha index, backward split" in text
    assert "4 contiguous windows, 2 of them drawn at random per sample" in text
    assert "window 0: transitions [0, 1, 2, 3, 4] (size 5) -> JAGG (jagg, split backward)" in text
    assert "2 backwards in 2 calls" in text
    assert "window 3: transitions [15, 16, 17, 18, 19] (size 5) -> exact" in text
    # windows cost 2, 2, 5, 5 backwards: 2 of 4 drawn -> expected 7, from 4 to 10, instead of 10
    assert "per sample: 7 transformer backwards expected (min 4, max 10) instead of 10" in text
    assert "vanilla trains 12 transitions" in text


def test_launch_window_split_tiny(cache_dir, tmp_path, capsys):
    assert helpers.run_main("jagg_patch", "dancegrpo.train_grpo_qwenimage", "--preset", "tiny", "--cache_dir",
                            cache_dir, "--output_dir", tmp_path, "--max_train_steps", "1", *FAST,
                            "--timestep_fraction", "1.0", "--jagg_window", "4", "--jagg_frac", "1.0",
                            "--jagg_grouping", "window", "--jagg_alpha", "index", "--jagg_backward", "split") == 0
    stdout = capsys.readouterr().out
    # qwen tiny: S 8 -> windows (0..3) JAGG and (4, 5, 6) JAGG, both trained (fraction 1): 2 + 2 backwards
    assert "window 1: transitions [4, 5, 6] (size 3) -> JAGG" in stdout
    (record,) = metrics(tmp_path)
    assert record["transformer_backwards"] == 8 * 4 and record["jagg_groups"] == 16
    assert record["activation_peak_mb"] > 0


def test_every_description_of_backward_auto_says_what_resolve_backward_does():
    import argparse
    import re

    import jagg_patch.__main__ as launcher
    import jagg_patch.upstream.__main__ as upstream_launcher
    from jagg_patch.cli import add_jagg_args
    from jagg_patch.core import resolve_backward
    parser = add_jagg_args(argparse.ArgumentParser())
    (action,) = [a for a in parser._actions if "--jagg_backward" in a.option_strings]
    with open(os.path.join(ROOT, "scripts", "launch.sh")) as f:
        script = f.read()
    expected = [(resolve_backward("auto", 2), resolve_backward("auto", 1))]
    for where, text in (("--jagg_backward help", action.help), ("python -m jagg_patch usage", launcher.USAGE),
                        ("python -m jagg_patch.upstream usage", upstream_launcher.USAGE),
                        ("scripts/launch.sh", script)):
        assert re.findall(r"auto: (\w+) on several ranks, (\w+) on one", " ".join(text.split())) == expected, where


def _jagg_args(*argv):
    import argparse
    from jagg_patch.cli import add_jagg_args
    return add_jagg_args(argparse.ArgumentParser()).parse_args([str(a) for a in argv])


def test_auto_with_the_monitor_turned_off_is_refused_not_turned_on(capsys):
    from jagg_patch.cli import jagg_config, monitor_for_auto
    with pytest.raises(SystemExit) as stop:
        monitor_for_auto(_jagg_args("--jagg_frac", "auto", "--jagg_monitor_every", 0))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "which --jagg_monitor_every 0 turns off" in err and len(err.splitlines()) == 1
    assert jagg_config(_jagg_args("--jagg_frac", "auto")).monitor_every == 10   # not given: 10, said
    assert "measured with --jagg_monitor_every 10" in capsys.readouterr().out
    assert jagg_config(_jagg_args("--jagg_frac", "auto", "--jagg_monitor_every", 3)).monitor_every == 3
    assert jagg_config(_jagg_args()).monitor_every == 0


def test_a_min_cos_that_nothing_reads_is_said_once(capsys):
    from jagg_patch.cli import jagg_config
    assert jagg_config(_jagg_args("--jagg_min_cos", 0.9)).min_cos == 0.9
    assert capsys.readouterr().out.count("--jagg_min_cos is the threshold of --jagg_frac auto; with --jagg_frac "
                                         "0.6 it is not used") == 1
    assert jagg_config(_jagg_args("--jagg_frac", "auto", "--jagg_min_cos", 0.9)).min_cos == 0.9
    assert jagg_config(_jagg_args("--jagg_frac", "auto")).min_cos == 0.8
    assert "not used" not in capsys.readouterr().out


def test_a_window_wider_than_the_trained_transitions_runs_and_is_recorded_as_built(cache_dir, tmp_path, capsys):
    """tiny: 4 trained transitions; --jagg_window 8 builds one group of 4, as --jagg_window 4 does: said
    once, and the plan, metrics.jsonl and run_config.json hold the window that ran (they held 8)."""
    assert helpers.run_main("jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                            "--output_dir", str(tmp_path / "o"), "--max_train_steps", "1", "--jagg_window", "8",
                            "--checkpointing_steps", "1") == 0
    out = capsys.readouterr().out
    assert out.count("notice: --jagg_window 8 is wider than the 4 transitions a sample trains") == 1
    assert "window 4, jagg_frac 0.6" in out and "group 0: positions [0, 1, 2, 3] (size 4) -> JAGG" in out
    (record,) = metrics(tmp_path / "o")
    assert record["jagg_groups"] == 128   # one group per sample (8 prompts x 16)
    config = json.load(open(tmp_path / "o" / "checkpoint-1-0" / "run_config.json"))
    assert config["jagg_window"] == 4


@pytest.mark.parametrize("flags, said", [((), "float32"), (("--mixed_precision", "bf16"), "bf16 autocast")])
def test_the_plan_says_what_the_kept_outputs_are_computed_in(flags, said, cache_dir):
    from jagg_patch.cli import add_jagg_args, jagg_plan_text
    from dancegrpo.args import parse_args
    import dancegrpo.train_grpo_flux as tf
    args = parse_args(add_jagg_args(tf.build_parser()), ["--preset", "tiny", "--cache_dir", cache_dir,
                                                          "--output_dir", "x", *flags])
    assert f"(the outputs as the model computes them: {said})" in jagg_plan_text(args)
