"""jagg_patch.tools.fidelity on the tiny preset: one cosine per group, each in [-1, 1]; window 2 reads 1.0."""
import json
import re

import pytest

from jagg_patch.tools.fidelity import main

GEOMETRY = ["--train_batch_size", "1", "--num_generations", "4", "--gradient_accumulation_steps", "4",
        "--sample_batch_size", "4", "--update_batch_size", "4", "--diag_samples", "4", "--fid_rollouts", "2"]


def run(cache_dir, tmp_path, window, capsys):
    out = tmp_path / f"w{window}"
    result = main(["dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                   "--output_dir", str(tmp_path / "run"), *GEOMETRY, "--jagg_window", str(window),
                   "--fid_out", str(out)])
    return result, capsys.readouterr().out, out


def printed_cosines(text):
    """(cos JAGG mean, cos endpoints mean) of every group row of the printed table."""
    rows = [line for line in text.splitlines() if re.match(r"\| \d", line)]
    return [tuple(float(c.split()[0]) for c in (line.split("|")[4], line.split("|")[6])) for line in rows]


@pytest.mark.parametrize("window", [2, 3])
def test_fidelity_prints_one_cosine_per_group(cache_dir, tmp_path, capsys, window):
    result, text, out = run(cache_dir, tmp_path, window, capsys)
    # tiny preset: S=8 -> 7 transitions, fraction 0.6 -> 4 trained: groups [2, 2] or [3, 1]
    expected_groups = {2: 2, 3: 2}[window]
    cosines = printed_cosines(text)
    assert len(cosines) == len(result["groups"]) == expected_groups
    assert len(result["per_rollout"]) == 2
    for row, (cj, ce) in zip(result["groups"], cosines):
        assert -1.0 <= cj <= 1.0 and -1.0 <= ce <= 1.0
        assert row["cos_jagg_mean"] == pytest.approx(cj, abs=1e-4)
        assert -1.0 <= row["cos_jagg_index_mean"] <= 1.0    # the authors' alpha rule, averaged too
        for r in result["per_rollout"]:
            assert -1.0 - 1e-12 <= r[row["group"]]["cos_jagg"] <= 1.0 + 1e-12
    if window == 2:
        for row in result["groups"]:
            assert row["cos_jagg_min"] == pytest.approx(1.0, abs=1e-6)
            assert row["cos_endpoints_min"] == pytest.approx(1.0, abs=1e-6)
    else:
        assert result["groups"][0]["cos_jagg_mean"] < 1 - 1e-6   # an approximation, not exact
        assert result["groups"][1]["size"] == 1 and result["groups"][1]["cos_jagg_min"] == pytest.approx(1.0, abs=1e-6)
    saved = json.loads((out / "fidelity.json").read_text())
    assert saved["window"] == window and len(saved["groups"]) == expected_groups
    assert (out / "fidelity.md").read_text().startswith("## Gradient fidelity")
    assert len((out / "fidelity.csv").read_text().splitlines()) == 1 + expected_groups
