"""python -m dancegrpo.evaluate on the tiny preset: outputs, determinism, checkpoints, bad input."""
import csv
import json
import math
import os

import numpy as np
import pytest
from PIL import Image

from dancegrpo import evaluate
from dancegrpo.utils.checkpoint import write_transformer_folder


def _run(cache_dir, out, *extra):
    return evaluate.main(["--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", str(out), "--device", "cpu",
                          *extra])


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_evaluate_preset_writes_csv_json_grid_table_and_repeats(cache_dir, tiny_hf_clip, tmp_path, capsys):
    _, clip_dir = tiny_hf_clip
    extra = ["--metrics", "jpeg,clipscore", "--clipscore_model_path", clip_dir, "--max_prompts", "3",
             "--num_images_per_prompt", "2", "--batch_size", "4"]
    _run(cache_dir, tmp_path / "a", *extra)
    printed = capsys.readouterr().out
    out = tmp_path / "a" / "preset-tiny"
    rows = _csv(out / "scores.csv")
    assert len(rows) == 6 and list(rows[0]) == ["prompt_index", "image_index", "seed", "prompt", "jpeg", "clipscore"]
    assert all(np.isfinite(float(r["clipscore"])) and float(r["clipscore"]) >= 0 for r in rows)
    summary = json.load(open(out / "summary.json"))
    assert summary["num_images"] == 6 and summary["sampler"] == "ode" and set(summary["metrics"]) == {"jpeg", "clipscore"}
    assert summary["metrics"]["jpeg"]["mean"] == pytest.approx(np.mean([float(r["jpeg"]) for r in rows]))
    grid = Image.open(out / "grid.png")
    assert grid.size == (2 * 64, 3 * 64)
    table = (tmp_path / "a" / "table.md").read_text().splitlines()
    assert table[0].startswith("| checkpoint | images | jpeg") and table[2].startswith("| preset-tiny | 6 |")
    assert table[2] in printed

    # Same seed and settings: identical scores and pixels.
    _run(cache_dir, tmp_path / "b", *extra)
    out_b = tmp_path / "b" / "preset-tiny"
    assert _csv(out_b / "scores.csv") == rows
    assert np.array_equal(np.asarray(Image.open(out_b / "grid.png")), np.asarray(grid))
    # Other batching: the same per-image noise, so the same images up to float rounding.
    _run(cache_dir, tmp_path / "c", *extra[:-1], "3")
    pixels_c = np.asarray(Image.open(tmp_path / "c" / "preset-tiny" / "grid.png")).astype(int)
    assert np.abs(pixels_c - np.asarray(grid).astype(int)).max() <= 2
    rows_c = _csv(tmp_path / "c" / "preset-tiny" / "scores.csv")
    np.testing.assert_allclose([float(r["clipscore"]) for r in rows_c], [float(r["clipscore"]) for r in rows],
                               atol=0.05)


def test_evaluate_computes_and_decodes_in_bf16_when_asked_on_cpu(cache_dir, tmp_path):
    """The trainer's rule: float32 on CPU by default, CPU bf16 autocast with --mixed_precision bf16
    (the transformer and the VAE decode), said in summary.json; the images move."""
    extra = ["--metrics", "jpeg", "--max_prompts", "2", "--num_images_per_prompt", "2"]
    found = {}
    for flags in ((), ("--mixed_precision", "bf16")):
        out = tmp_path / ("bf16" if flags else "default")
        _run(cache_dir, out, *extra, *flags)
        summary = json.load(open(out / "preset-tiny" / "summary.json"))
        found[summary["precision"]] = [float(r["jpeg"]) for r in _csv(out / "preset-tiny" / "scores.csv")]
    assert set(found) == {"float32", "bf16 autocast"} and found["float32"] != found["bf16 autocast"]


def test_evaluate_compares_checkpoints_and_sde(cache_dir, tmp_path, capsys):
    from diffusers import FluxTransformer2DModel
    root = os.path.join(cache_dir, "presets")
    _run(cache_dir, tmp_path / "warm", "--max_prompts", "1")  # builds the preset
    preset = os.path.join(root, os.listdir(root)[0])
    model = FluxTransformer2DModel.from_pretrained(preset, subfolder="transformer")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    write_transformer_folder(str(tmp_path / "checkpoint-1-0"), state, model.config)
    state["proj_out.weight"] = state["proj_out.weight"] * 3
    write_transformer_folder(str(tmp_path / "ablation"), state, model.config)
    capsys.readouterr()
    _run(cache_dir, tmp_path / "cmp", "--max_prompts", "2", "--checkpoint", f"vanilla={preset}",
         "--checkpoint", str(tmp_path / "checkpoint-1-0"), "--checkpoint", f"ablation={tmp_path / 'ablation'}")
    table = (tmp_path / "cmp" / "table.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:5]] == ["vanilla", "checkpoint-1-0", "ablation"]
    scores = {lab: [r["jpeg"] for r in _csv(tmp_path / "cmp" / lab / "scores.csv")]
              for lab in ("vanilla", "checkpoint-1-0", "ablation")}
    assert scores["vanilla"] == scores["checkpoint-1-0"]  # same weights, same seeds -> same images
    assert scores["ablation"] != scores["vanilla"]
    assert len(json.load(open(tmp_path / "cmp" / "comparison.json"))) == 3

    # A later evaluation of the same settings adds its rows; a label evaluated again replaces its own.
    _run(cache_dir, tmp_path / "cmp", "--max_prompts", "2")
    again = _csv(tmp_path / "cmp" / "preset-tiny" / "scores.csv")
    capsys.readouterr()
    _run(cache_dir, tmp_path / "cmp", "--max_prompts", "2")
    assert "preset-tiny evaluated again: the earlier row is replaced" in capsys.readouterr().err
    assert _csv(tmp_path / "cmp" / "preset-tiny" / "scores.csv") == again
    table = (tmp_path / "cmp" / "table.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:6]] == ["vanilla", "checkpoint-1-0", "ablation",
                                                                   "preset-tiny"]
    assert table[-1].startswith("Every row: family flux, sampler ode, sampling_steps 8"), table[-1]
    assert [s["label"] for s in json.load(open(tmp_path / "cmp" / "comparison.json"))][-1] == "preset-tiny"
    # The SDE draws other images: its own table.
    _run(cache_dir, tmp_path / "sde", "--max_prompts", "2", "--sde", "--eta", "0.3")
    sde = _csv(tmp_path / "sde" / "preset-tiny" / "scores.csv")
    assert [r["jpeg"] for r in sde] != scores["vanilla"]
    assert json.load(open(tmp_path / "sde" / "preset-tiny" / "summary.json"))["sampler"] == "sde"


@pytest.mark.parametrize("flags,named", [
    (("--mixed_precision", "bf16", "--sampling_steps", "3", "--seed", "5"),
     ("precision 'float32' -> 'bf16 autocast'", "sampling_steps 8 -> 3", "seed 0 -> 5")),
    (("--sampling_steps", "12", "--shift", "1.0", "--guidance", "1.0"),
     ("sampling_steps 8 -> 12", "shift", "guidance 3.5 -> 1.0")),
    (("--sde", "--eta", "0.3"), ("sampler 'ode' -> 'sde'", "eta None -> 0.3")),
    (("--max_prompts", "3"), ("prompts '2 (sha256",)),
])
def test_a_row_of_other_sampling_settings_is_refused_before_any_model_loads(cache_dir, tmp_path, capsys,
                                                                          monkeypatch, flags, named):
    """table.md compares checkpoints: a row drawn with another sampler, steps, shift, guidance,
    precision, seed or prompt set would differ by its settings alone, so it does not join."""
    _run(cache_dir, tmp_path / "t", "--max_prompts", "2", "--checkpoint", "base=" + _preset_root(cache_dir))
    before = (tmp_path / "t" / "table.md").read_text()
    from dancegrpo import eval_run
    monkeypatch.setattr(eval_run, "load_vae", lambda *a: pytest.fail("loaded a model before refusing"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        _run(cache_dir, tmp_path / "t", "--max_prompts", "2", *flags)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "holds rows sampled with other settings" in err, err
    assert len(err.strip().splitlines()) == 1 and all(n in err for n in named), err
    assert (tmp_path / "t" / "table.md").read_text() == before and not (tmp_path / "t" / "preset-tiny").exists()


def _preset_root(cache_dir):
    from dancegrpo import presets
    return presets.materialize_preset("flux", "tiny", cache_dir)


def test_evaluate_refuses_a_folder_in_use_and_one_of_other_metrics(cache_dir, tmp_path, capsys, monkeypatch):
    from dancegrpo.run.rundir import RunLock
    (tmp_path / "held").mkdir()
    lock = RunLock(str(tmp_path / "held"), "another").acquire()
    try:
        with pytest.raises(SystemExit) as stop:
            _run(cache_dir, tmp_path / "held", "--max_prompts", "1")
        assert stop.value.code == 2 and "is in use by another run" in capsys.readouterr().err
    finally:
        lock.release()
    (tmp_path / "jpeg").mkdir()
    (tmp_path / "jpeg" / "comparison.json").write_text(json.dumps([{"label": "x", "metrics": {"jpeg": {}}}]))
    from dancegrpo import eval_run
    monkeypatch.setattr(eval_run, "load_vae", lambda *a: pytest.fail("loaded a model before refusing"))
    with pytest.raises(SystemExit) as stop:
        _run(cache_dir, tmp_path / "jpeg", "--max_prompts", "1", "--metrics", "jpeg,jpeg_incompressibility")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "holds an evaluation of the metrics ['jpeg']" in err, err


def test_evaluate_prompt_file_selects_by_caption(cache_dir, tmp_path):
    from dancegrpo.presets import bundled_prompts
    prompts = bundled_prompts(8)
    pf = tmp_path / "prompts.txt"
    pf.write_text(f"\n{prompts[5]}\n\n  {prompts[2]}  \n")
    _run(cache_dir, tmp_path / "o", "--prompt_file", str(pf))
    rows = _csv(tmp_path / "o" / "preset-tiny" / "scores.csv")
    assert [r["prompt"] for r in rows] == [prompts[5], prompts[2]]


@pytest.mark.parametrize("case, message", [
    ("empty", "holds no prompts"),
    ("unmatched", "have no embedding"),
    ("bad_checkpoint", "neither a transformer folder"),
    ("missing_checkpoint", "does not exist"),
    ("bad_metric", "Unknown reward"),
    ("missing_clip", "--clipscore_model_path"),
])
def test_evaluate_bad_input_names_the_fix(cache_dir, tmp_path, capsys, case, message):
    extra = []
    if case in ("empty", "unmatched"):
        pf = tmp_path / "p.txt"
        pf.write_text("\n \n" if case == "empty" else "a prompt that was never embedded\n")
        extra = ["--prompt_file", str(pf)]
    elif case == "bad_checkpoint":
        extra = ["--checkpoint", str(tmp_path)]
    elif case == "missing_checkpoint":
        extra = ["--checkpoint", str(tmp_path / "nowhere")]
    elif case == "bad_metric":
        extra = ["--metrics", "nope"]
    else:
        extra = ["--metrics", "clipscore", "--clipscore_model_path", str(tmp_path / "none")]
    with pytest.raises(SystemExit) as exc:
        _run(cache_dir, tmp_path / "o", *extra)
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


def test_evaluate_qwenimage_family(cache_dir, tmp_path):
    """The same CLI on the Qwen-Image family: the jpeg score of each image equals the
    built-in reward of the image it writes (scores belong to their images)."""
    from dancegrpo.rewards.builtin import jpeg_kilobytes
    _run(cache_dir, tmp_path / "q", "--family", "qwenimage", "--metrics", "jpeg", "--max_prompts", "2",
         "--save_images")
    out = tmp_path / "q" / "preset-tiny"
    rows = _csv(out / "scores.csv")
    assert len(rows) == 2
    for r in rows:
        image = Image.open(out / "images" / f"p{int(r['prompt_index']):04d}_i{int(r['image_index']):02d}.png")
        assert image.size == (64, 64)
        assert float(r["jpeg"]) == pytest.approx(-jpeg_kilobytes(image), abs=1e-6)


def test_evaluate_flags_a_checkpoint_with_nan_weights(cache_dir, tmp_path, capsys):
    """A diverged run's checkpoint is marked NON-FINITE with no score, not ranked; the others are scored."""
    import torch
    from diffusers import FluxTransformer2DModel
    _run(cache_dir, tmp_path / "warm", "--max_prompts", "1")
    root = os.path.join(cache_dir, "presets")
    preset = os.path.join(root, next(d for d in os.listdir(root) if d.startswith("flux-tiny")))
    model = FluxTransformer2DModel.from_pretrained(preset, subfolder="transformer")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["proj_out.weight"] = torch.full_like(state["proj_out.weight"], float("nan"))
    write_transformer_folder(str(tmp_path / "diverged"), state, model.config)
    capsys.readouterr()
    summaries = _run(cache_dir, tmp_path / "cmp", "--max_prompts", "1", "--checkpoint", f"base={preset}",
                     "--checkpoint", f"diverged={tmp_path / 'diverged'}")
    assert "proj_out.weight" in summaries[1]["nonfinite"] and summaries[1]["metrics"]["jpeg"]["mean"] is None
    assert summaries[0].get("nonfinite") is None and math.isfinite(summaries[0]["metrics"]["jpeg"]["mean"])
    table = (tmp_path / "cmp" / "table.md").read_text()
    assert "| diverged (NON-FINITE) | 0 | n/a |" in table
    assert "diverged: 1 weight tensor(s) hold NaN/inf" in capsys.readouterr().err


def test_a_pruned_checkpoint_is_said_missing_naming_what_its_run_holds(cache_dir, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint-6-0").mkdir(parents=True)
    with pytest.raises(SystemExit) as exc:
        _run(cache_dir, tmp_path / "o", "--checkpoint", str(run / "checkpoint-2-0"))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert "checkpoint-2-0' does not exist (a run's --checkpoints_total_limit may have deleted it)" in err
    assert err.endswith("holds checkpoint-6-0")


def test_another_familys_checkpoint_is_refused_before_the_folder_is_made(cache_dir, tmp_path, capsys):
    _run(cache_dir, tmp_path / "warm", "--max_prompts", "1")
    root = os.path.join(cache_dir, "presets")
    flux = os.path.join(root, next(d for d in os.listdir(root) if d.startswith("flux-tiny")))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        _run(cache_dir, tmp_path / "o", "--family", "qwenimage", "--checkpoint", f"flux={flux}")
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and "pick the matching --family" in err and len(err.strip().splitlines()) == 1
    assert "|" not in out and not (tmp_path / "o").exists()   # no table header printed, no folder made


def test_a_checkpoint_trained_on_another_preset_is_warned_about(cache_dir, tmp_path, capsys):
    root = os.path.join(cache_dir, "presets")
    _run(cache_dir, tmp_path / "warm", "--max_prompts", "1")
    preset = os.path.join(root, next(d for d in os.listdir(root) if d.startswith("flux-tiny")))
    trained = tmp_path / "checkpoint-3-0"
    import shutil
    shutil.copytree(os.path.join(preset, "transformer"), trained)
    (trained / "run_config.json").write_text(json.dumps({"preset": "digits", "family": "flux"}))
    capsys.readouterr()
    _run(cache_dir, tmp_path / "o", "--max_prompts", "1", "--checkpoint", f"t={trained}")
    err = capsys.readouterr().err
    assert "warning: t: trained with --preset digits (run_config.json), evaluated with --preset tiny" in err
    (trained / "run_config.json").write_text(json.dumps({"preset": "tiny", "family": "flux"}))
    _run(cache_dir, tmp_path / "o2", "--max_prompts", "1", "--checkpoint", f"t={trained}")
    assert "warning" not in capsys.readouterr().err


def test_a_full_disk_is_one_line_exit_3_and_leaves_no_half_written_file(cache_dir, tmp_path, capsys, monkeypatch):
    import errno
    from PIL import Image as PILImage
    real_save = PILImage.Image.save

    def save(self, fp, *a, **kw):
        real_save(self, fp, *a, **kw)
        if not isinstance(fp, (str, os.PathLike)):
            return   # the jpeg metric's in-memory encoding
        with open(fp, "r+b") as f:   # half of it written, then the disk is full
            f.truncate(os.path.getsize(fp) // 2)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(PILImage.Image, "save", save)
    with pytest.raises(SystemExit) as exc:
        _run(cache_dir, tmp_path / "o", "--max_prompts", "1")
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 3 and len(err.splitlines()) == 1 and err.startswith("stopped: no space left")
    assert "Traceback" not in err
    written = sorted(os.listdir(tmp_path / "o" / "preset-tiny"))
    assert written == ["scores.csv"], written   # no grid.png, no temporary beside it
