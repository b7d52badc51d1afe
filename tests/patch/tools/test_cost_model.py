"""jagg_patch.tools.cost_model: pass counts of the variants at the paper's geometries, and the B/F ratio
each would need for the paper's speed figures, checked against the step-time equation by hand."""
import pytest


def test_cost_model_passes_and_implied_ratio():
    from jagg_patch.tools.cost_model import paper_table
    rows = {(r["model"], r["variant"].split(":")[0].split(",")[0]): r for r in paper_table()}
    flux, qwen = rows[("Flux", "paper")], rows[("Qwen-Image", "paper")]
    # Flux S 16: 9 trained -> [4J, 4J, 1E]: grad forwards 2+2+1, no-grad 2+2, backwards 5
    assert flux["passes"] == (5, 4, 5)
    assert rows[("Flux", "same groups")]["passes"] == (5, 8, 5)
    assert rows[("Flux", "rollout reuse")]["passes"] == (5, 0, 5)     # the middles' 4 no-grad forwards gone
    assert rows[("Qwen-Image", "rollout reuse")]["passes"] == (7, 0, 7)
    # Qwen S 20: 11 -> [4J, 4J, 3E]; the authors' run: S 21, 5 windows of 4, 3 trained, each 2 F + 4 F0 + 2 B
    assert qwen["passes"] == (7, 4, 7)
    assert rows[("Qwen-Image", "authors' code")]["passes"] == (6, 12, 6)
    # the implied B/F solves the step-time equation written out by hand (rollout S forwards)
    x = flux["implied_b_over_f"]
    assert 16 + 5 + 4 + 5 * x == pytest.approx((1 - flux["paper_gain"]) * (16 + 9 + 9 * x), rel=1e-12)
    x = qwen["implied_b_over_f"]
    assert 20 + 7 + 4 + 7 * x == pytest.approx((1 - qwen["paper_gain"]) * (20 + 11 + 11 * x), rel=1e-12)
    plain, checkpointed = flux["predicted"].values()
    assert plain == pytest.approx(1 - (25 + 10) / (25 + 18), rel=1e-12)
    # gradient checkpointing recomputes the forward in every backward: B = 2 F + F, by hand
    assert checkpointed == pytest.approx(1 - (25 + 5 * 3) / (25 + 9 * 3), rel=1e-12)


def test_checkpointing_adds_a_forward_to_each_backward():
    from jagg_patch.tools.cost_model import Variant, backward_units, step_gain
    assert backward_units(2.0) == 2.0 and backward_units(2.0, 1.0) == 3.0 and backward_units(2.0, 0.5) == 2.5
    vanilla, jagg = Variant("v", 16, (9, 0, 9)), Variant("j", 16, (5, 0, 5))
    assert vanilla.units(2.0, 0.5) == 16 + 9 + 9 * 2.5
    assert step_gain(2.0, vanilla, jagg, 1.0) > step_gain(2.0, vanilla, jagg)   # a saved backward is worth more


def test_the_command_takes_no_argument_and_refuses_one(capsys):
    from jagg_patch.tools.cost_model import main
    with pytest.raises(SystemExit) as stop:
        main(["--gpu", "h100"])
    assert stop.value.code == 2 and "unrecognized arguments: --gpu h100" in capsys.readouterr().err
    main([])
    assert "| model (paper gain) |" in capsys.readouterr().out
