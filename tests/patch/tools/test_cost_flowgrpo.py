"""jagg_patch.tools.cost_flowgrpo: the rows per sample of Flow-GRPO's SD3 recipe through the deferred
proxy, counted by hand."""
import pytest


def test_flowgrpo_rows_by_hand():
    from jagg_patch.tools.cost_flowgrpo import flowgrpo_passes
    p = flowgrpo_passes(3, 1.0)   # S 10, 9 trained, CFG, KL, two optimizer steps per epoch
    vanilla, deferred, reuse = p["vanilla"], p["deferred"], p["deferred + reuse"]
    # vanilla: 10 doubled rollout calls; 9 doubled calls with grad and their backwards; 9 doubled KL calls
    assert (vanilla.rollout, vanilla.nograd, vanilla.grad, vanilla.backward) == (20, 18, 18, 18)
    # deferred: the 9 doubled calls without grad + the KL's; 3 JAGG groups x 2 endpoints, cond rows only
    assert (deferred.nograd, deferred.grad, deferred.backward) == (36, 6, 6)
    # reuse: half the epoch's samples on-policy (before the first optimizer step): 9 of the 18 rows
    assert reuse.nograd == 27
    assert deferred.update_units(2.0) / vanilla.update_units(2.0) == pytest.approx((36 + 6 + 12) / (18 + 18 + 36))
    one_group = flowgrpo_passes(9, 1.0, cfg=False, kl=False, optimizer_steps=1)
    assert (one_group["deferred"].grad, one_group["deferred"].nograd, one_group["deferred + reuse"].nograd) == (2, 9, 0)
    routed = flowgrpo_passes(3, 0.6)["deferred"]   # round(3 x 0.6) = 2 JAGG groups, one exact group of 3
    assert routed.grad == 2 + 2 + 3


def test_the_command_prints_the_recipe_table(capsys):
    from jagg_patch.tools.cost_flowgrpo import main
    main([])
    out = capsys.readouterr().out
    assert "| 3, 1.0 | deferred | 20, 36, 6, 6 | 0.750 |" in out
    with pytest.raises(SystemExit) as stop:
        main(["--window", "3"])
    assert stop.value.code == 2
