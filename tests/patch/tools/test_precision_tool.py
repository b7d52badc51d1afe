"""jagg_patch.tools.precision on the tiny preset in bf16: the on-policy ratios of vanilla and JAGG and the
transitions each clips, and the group gradients against float64."""
import json

import pytest

from jagg_patch.tools import precision

from helpers import FAST

W = 4   # 4 trained transitions per sample: one group, 2 middle members


def _run(cache_dir, tmp_path, *extra):
    out = tmp_path / "prec.json"
    precision.main(["dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
                    str(tmp_path / "run"), *map(str, FAST), "--mixed_precision", "bf16", "--jagg_window", str(W),
                    "--jagg_frac", "1", "--prec_json", str(out), *extra])
    return json.loads(out.read_text())


def test_a_recompute_rounded_otherwise_clips_vanillas_transitions_and_reused_middles_stay_at_one(cache_dir, tmp_path):
    """Rollout in bf16, the update's forwards in float32 (rounding that is not the rollout's, as another
    kernel's can be on a GPU): |r - 1| reaches past upstream's clip range 1e-4 (measured up to 2.3e-3,
    29 of 32 pairs clipped); JAGG without reuse recomputes every member and clips the same pairs; with
    the rollout's outputs its middle members keep r = 1 exactly, so it clips a subset of vanilla's."""
    r = _run(cache_dir, tmp_path, "--prec_parts", "ratio", "--prec_update_precision", "no")["ratio"]
    vanilla, fresh, reused = r["vanilla"], r["jagg"], r["jagg_reuse"]
    samples = 8
    assert vanilla["pairs"] == fresh["pairs"] == reused["pairs"] == samples * W
    assert vanilla["clipped_pairs"] > samples * (W - 2)   # more than the endpoints alone could hold
    assert (fresh["clipped_pairs"], fresh["clipped_not_vanilla"], fresh["vanilla_clipped_not_this"]) == \
        (vanilla["clipped_pairs"], 0, 0)
    assert reused["clipped_not_vanilla"] == 0 and reused["clipped_pairs"] <= samples * 2
    assert reused["vanilla_clipped_not_this"] == vanilla["clipped_pairs"] - reused["clipped_pairs"] > 0


def test_in_bf16_on_cpu_the_recompute_is_the_rollouts_and_bf16s_error_is_measured_against_float64(cache_dir,
                                                                                                tmp_path):
    """The update recomputes in bf16 as the rollout did: every ratio is 1 (bf16 on this CPU does not
    depend on the batch shape), nothing clips. The gradients: float32 is float64's to rounding, JAGG's
    error is the same in float32 and float64 (its approximation), and bf16 moves the exact gradient."""
    result = _run(cache_dir, tmp_path, "--prec_samples", "8")
    assert all(entry["clipped_pairs"] == 0 and entry["summary"]["ratio_max"] == entry["summary"]["ratio_min"] == 1
               for entry in result["ratio"].values())
    (group,) = result["gradient"]["groups"]
    assert group["size"] == W and group["relerr_float32_exact"] < 1e-5
    assert group["relerr_float32_jagg"] == pytest.approx(group["relerr_float64_jagg"], rel=1e-3)
    assert group["relerr_float64_jagg"] > 1e-3 and group["relerr_run_exact"] > 1e-3
    assert group["cos_run_exact"] < 1 - 1e-4 and group["cos_run_jagg"] < group["cos_float64_jagg"]
    # Module by module, bf16's error grows from the input projection to the velocity
    modules = {m["module"]: m["relerr"] for m in result["layers"]["modules"]}
    assert 1e-4 < modules["x_embedder"] < modules["proj_out"] and result["layers"]["samples"] == 8
