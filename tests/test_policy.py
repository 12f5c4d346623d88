"""Layer policies: which layers stay softmax attention."""
import pytest

from taylor_calibrate.policy import gdn_layers, kept_layers


def test_uniform_keeps_every_kth_from_zero():
    assert kept_layers("uniform", 30, 4) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert gdn_layers([0, 4], 6) == [1, 2, 3, 5]


def test_explicit_list_and_ranges():
    assert kept_layers("layers=8,0,4", 12) == [0, 4, 8]
    assert kept_layers("layers=0-2,7", 12) == [0, 1, 2, 7]


@pytest.mark.parametrize("policy, match", [
    ("layers=0,30", "out of range"),
    ("layers=-1", "bad layer list entry|out of range"),
    ("layers=1,1", "more than once"),
    ("layers=a", "bad layer list entry"),
    ("layers=", "keeps no attention layer"),
    ("layers=0-29", "nothing would be converted"),
    ("greedyish", "unknown layer policy"),
])
def test_bad_policies_get_clear_errors(policy, match):
    with pytest.raises(ValueError, match=match):
        kept_layers(policy, 30)


def test_keep_every_out_of_range():
    with pytest.raises(ValueError, match="keep_every"):
        kept_layers("uniform", 30, 0)
    with pytest.raises(ValueError, match="nothing would be converted"):
        kept_layers("uniform", 30, 1)


def test_scored_policies_treat_near_equal_scores_as_ties_in_layer_order():
    """Scores equal at SCORE_RESOLUTION (run-to-run GPU rounding) do not decide: the lower layer wins the tie, so a
    rerun keeps the same layers; a real difference still decides."""
    near_tie = [-2.0, -1.0004, -1.0001, -3.0]
    assert kept_layers("greedy", 4, 4, near_tie) == [1]
    assert kept_layers("greedy", 4, 4, [-2.0, -1.05, -1.0, -3.0]) == [2]
    assert kept_layers("bypass", 4, 4, [0.1, 0.5002, 0.5004, 0.2]) == [1]


def test_kv_budget_keeps_at_most_that_fraction():
    from taylor_calibrate.policy import kept_count

    assert kept_count(30, 4) == 8  # one in four, rounded up (the keep_every shorthand)
    assert kept_count(30, 4, kv_budget=0.25) == 7 and kept_count(90, 4, kv_budget=0.25) == 22
    assert kept_count(30, 4, kv_budget=0.01) == 1
    assert kept_layers("uniform", 30, 4, kv_budget=0.25) == [0, 4, 8, 12, 17, 21, 25]
    with pytest.raises(ValueError, match="kv_budget"):
        kept_count(30, 4, kv_budget=1.0)


def test_head_policy_keeps_the_top_groups_deterministically():
    """Groups ranked by score over all layers; near-equal scores tie in (layer, group) order; every layer listed."""
    import torch

    from taylor_calibrate.policy import group_scores, kept_groups_of, layer_groups

    heads = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.30001, 0.3, 0.0, 0.0], [0.3, 0.30002, 0.0, 0.0]])  # 3 layers x 4 q
    groups = group_scores(heads, 2)  # 2 groups of 2 query heads each
    assert torch.allclose(groups, torch.tensor([[0.0, 1.0], [0.60001, 0.0], [0.60002, 0.0]]))
    kept = kept_groups_of(groups, keep_every=4, kv_budget=0.5)  # 3 of 6 groups
    assert kept == {0: [1], 1: [0], 2: [0]}
    assert kept_groups_of(groups, keep_every=4, kv_budget=0.2) == {0: [1], 1: [], 2: []}
    assert kept_groups_of(groups.clone(), 4, 0.5) == kept, "same scores, same choice"
    assert layer_groups([1], 3, 2) == {0: [], 1: [0, 1], 2: []}
