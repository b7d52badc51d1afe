"""`python -m jagg_patch.deferred SCRIPT ...`: what it refuses, in one line before the script or torch
loads (the SD stand-in's run through it: tests/patch/upstream/test_upstream_sd.py)."""
import pytest


@pytest.mark.parametrize("argv, said", [
    ([], None),
    (["--jagg_window", "4"], "no script given"),
    (["{tmp}"], "is a folder; give the training script in it"),
    (["{tmp}/missing.py"], "does not exist"),
    (["{tmp}/notes.txt"], "is not a Python file"),
    (["--bogus", "{tmp}/train.py"], "unknown flag --bogus before the script (its own flags go after it)"),
    (["{tmp}/train.py", "--jagg_windw", "4", "--", "--x"], "unknown flag --jagg_windw; did you mean --jagg_window?"),
    (["{tmp}/train.py", "--jagg_grouping", "window"], "use --jagg_grouping trained"),
    (["{tmp}/train.py", "--jagg_frac", "auto"], "has no fidelity monitor"),
    (["{tmp}/train.py", "--jagg_window", "1"], "--jagg_window: must be >= 2"),
    (["{tmp}/train.py", "--jagg_metrics_dir", "{tmp}/notes.txt/m"], "--jagg_metrics_dir '{tmp}/notes.txt/m' is not "
                                                                   "writable")],
    ids=["nothing", "no-script", "folder", "missing", "not-py", "flag-first", "typo", "window-grouping", "auto",
         "bad-window", "unwritable-metrics-dir"])
def test_what_the_launcher_cannot_run_is_one_line_before_the_script_runs(argv, said, tmp_path, capsys):
    from jagg_patch.deferred.__main__ import main
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "train.py").write_text("raise SystemExit('the script ran')\n")
    with pytest.raises(SystemExit) as stop:
        code = main([a.format(tmp=tmp_path) for a in argv])
        raise SystemExit(code)
    err = capsys.readouterr().err.strip()
    if said is None:   # no argument: the usage, exit 2
        assert stop.value.code == 2
        return
    assert stop.value.code == 2 and said.format(tmp=tmp_path) in err and len(err.splitlines()) <= 2, err
    assert "the script ran" not in err


def test_exact_mode_runs_the_script_as_it_is_and_its_own_flags_reach_it(tmp_path, capsys):
    """After `--` every argument is the script's, a --jagg_ one included; before it, JAGG's are taken out."""
    from jagg_patch.deferred.__main__ import main
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('argv', sys.argv[1:])\n")
    assert main([str(script), "--jagg_mode", "exact", "--lr", "1", "--", "--jagg_window", "2", "-x"]) == 0
    assert "argv ['--lr', '1', '--jagg_window', '2', '-x']" in capsys.readouterr().out


def test_a_script_that_prepares_no_model_is_said_to_have_run_without_jagg(tmp_path, capsys):
    from jagg_patch.deferred.__main__ import main
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    assert main([str(script), "--jagg_window", "3"]) == 0
    out = capsys.readouterr()
    assert "trained" in out.out and "prepared no model with trainable parameters" in out.err


def test_a_model_the_guard_cannot_serve_stops_the_script_in_one_line(tmp_path, capsys):
    """A prepared model with dropout (the replay would draw another mask): one line naming it, exit 1,
    before the script goes on; no notice that JAGG did nothing."""
    from jagg_patch.deferred.__main__ import main
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom accelerate import Accelerator\n"
                      "model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))\n"
                      "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "model, optimizer = Accelerator().prepare(model, optimizer)\nprint('went on')\n")
    assert main([str(script), "--jagg_metrics_dir", str(tmp_path / "m")]) == 1
    out = capsys.readouterr()
    assert "went on" not in out.out
    assert out.err.strip().splitlines() == [out.err.strip()] and "cannot replay Dropout(p=0.1)" in out.err
