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
    (["--jagg_deferred", "{tmp}/train.py"], "has no use for --jagg_deferred (it is the deferred update already)"),
    (["{tmp}/train.py", "--jagg_min_cos=0.5"], "has no use for --jagg_min_cos"),
    (["{tmp}/train.py", "--jagg_metrics_dir", "{tmp}/notes.txt/m"], "--jagg_metrics_dir '{tmp}/notes.txt/m' is not "
                                                                   "writable")],
    ids=["nothing", "no-script", "folder", "missing", "not-py", "flag-first", "typo", "window-grouping", "auto",
         "bad-window", "deferred", "min-cos", "unwritable-metrics-dir"])
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


def test_a_scripts_own_help_is_not_said_to_have_run_without_jagg(tmp_path, capsys):
    from jagg_patch.deferred.__main__ import main
    script = tmp_path / "train.py"
    script.write_text("import sys\nif '--help' in sys.argv:\n    print('usage: train.py')\n    raise SystemExit(0)\n")
    with pytest.raises(SystemExit) as stop:
        main([str(script), "--", "--help"])
    out = capsys.readouterr()
    assert stop.value.code == 0 and "usage: train.py" in out.out and "JAGG did nothing" not in out.err


# A script as research code writes it: the clip imported at its top (bound before any proxy exists),
# accelerate's prepare, a rollout under no_grad, one backward per trained step, the clip, the step.
SCRIPT = """import sys
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.nn.utils import clip_grad_norm_
from deferred_loops import DT, Velocity

project = ProjectConfiguration(project_dir=sys.argv[1]) if len(sys.argv) > 1 else None
accelerator = Accelerator(cpu=True, project_config=project)
model = Velocity()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
g = torch.Generator().manual_seed(0)
text = torch.randn(2, 2, 3, generator=g, dtype=DT)
t = [torch.full((2,), 1.0 - 0.2 * k, dtype=DT) for k in range(5)]
z = [torch.randn(2, 5, 4, generator=g, dtype=DT)]
with torch.no_grad():
    for k in range(4):
        z.append(z[k] - 0.2 * model(z[k], t[k], text).sample + 0.05 * torch.randn(z[k].shape, generator=g, dtype=DT))
for step in range(2):
    for k in range(4):
        v = model(z[k], t[k], text).sample
        ((z[k] - 0.2 * v - z[k + 1]) ** 2).mean().backward()
    print("grad_norm", repr(float(clip_grad_norm_(model.parameters(), 0.01))))
    optimizer.step()
    optimizer.zero_grad()
"""


def grad_norms(text):
    return [float(line.split()[1]) for line in text.splitlines() if line.startswith("grad_norm")]


@pytest.mark.parametrize("project", [True, False], ids=["project-dir", "working-folder"])
def test_a_clip_the_script_imported_sees_the_gradient_and_the_run_ends_with_a_summary(project, tmp_path, capsys,
                                                                                       monkeypatch):
    """W 2 (each row its own signal: the exact gradient): the clip the script imported at its top returns
    vanilla's norm at each step; the metrics go to the folder the script names to accelerate, else the
    working folder, said; one summary line at the end."""
    import json
    from jagg_patch.deferred.__main__ import main, run_script
    script, folder = tmp_path / "train.py", tmp_path / "project"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    own = [str(folder)] if project else []
    run_script(str(script), own)
    plain = grad_norms(capsys.readouterr().out)
    assert main([str(script), "--jagg_window", "2", "--jagg_frac", "1", "--", *own]) == 0
    out = capsys.readouterr()
    got = grad_norms(out.out)
    assert len(plain) == 2 and plain[1] != plain[0] and got == pytest.approx(plain, rel=1e-12)
    metrics = (folder if project else tmp_path) / "jagg_metrics.jsonl"
    assert f"one line per flush in {metrics}" in out.out
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["deferred_rows_deferred"] for line in lines] == [8, 8]
    replayed, backwards = (sum(line[f"deferred_{n}"] for line in lines) for n in ("forwards_grad", "backward_calls"))
    assert out.err.strip().splitlines()[-1] == (
        f"jagg_patch.deferred: 2 flushes, 16 rows deferred in 8 calls; trained exactly: none; {replayed} rows "
        f"replayed with grad in {backwards} backwards, where vanilla backpropagates 16 rows in 8: {8 - backwards} "
        f"backwards saved ({backwards} for vanilla's 8); counts per flush in {metrics}")
