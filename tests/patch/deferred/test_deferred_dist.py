"""jagg_patch.deferred on two ranks (tests/dist/deferred_check.py, in the suite's one torchrun launch):
DDP with the proxy outside it (ranks with different replay counts, and a rank with nothing to
replay), and this project's trainer on FSDP1 and FSDP2 against the single-process restated update."""
import pytest

import helpers


@pytest.mark.parametrize("dist_result", [helpers.dist_check("deferred-ddp", "deferred", ["--deferred_case", "ddp_loop"])],
                         indirect=True, ids=helpers.dist_id)
def test_ddp_every_rank_one_synced_backward_per_flush(dist_result):
    for rank in dist_result["ranks"]:
        for case in ("uneven", "one_rank_idle"):
            got = rank[case]
            assert got["rel_err"] < 1e-12, (case, got)
            assert got["steps"] == got["flushes"] == got["ddp_forwards"] == 1, (case, got)
    uneven = [rank["uneven"]["chunks"] for rank in dist_result["ranks"]]
    assert uneven[0] != uneven[1]   # the ranks replayed different numbers of chunks
    idle = [rank["one_rank_idle"] for rank in dist_result["ranks"]]
    assert idle[0]["padding_rows"] == 0 and idle[1]["padding_rows"] == 1 and idle[1]["chunks"] == 1


@pytest.mark.parametrize("dist_result", [
    helpers.dist_check("deferred-fsdp1", "deferred", ["--engine", "fsdp"]),
    helpers.dist_check("deferred-fsdp2", "deferred", ["--engine", "fsdp2", "--jagg_reuse_rollout", "off"]),
], indirect=True, ids=helpers.dist_id)
def test_fsdp_deferred_equals_the_single_process_restated_update(dist_result):
    ranks = dist_result["ranks"]
    for rank in ranks:
        assert rank["rel_err"] < 1e-12 and rank["dtype"] == "torch.float64", rank
        assert rank["exact_rows"] == 0
    assert ranks[0]["chunks"] == ranks[1]["chunks"] and ranks[1]["padding_rows"] > 0 == ranks[0]["padding_rows"]
    assert [r["jagg_groups"] for r in ranks] == [r["samples"] for r in ranks]   # one group per sample (W 4, 4 trained)
    assert ranks[1]["zero_rows"] > ranks[0]["zero_rows"]
