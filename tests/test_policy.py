"""Layer policies: which layers stay softmax attention."""
import pytest
import torch

from taylor_calibrate.policy import gdn_layers, kept_layers, rank_order


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


# --- --kv_budget in bytes (memory.ByteBudget) ------------------------------------------------------------------------
def _windowed_budget(fraction, window=64, context=1024):
    """A Gemma-3-like teacher: layers 2 and 5 global, the others sliding (`window`); 4 query heads, 1 KV group."""
    import torch
    from transformers import AutoConfig

    from taylor_calibrate.config import GDNConfig
    from taylor_calibrate.memory import byte_budget

    types = ["sliding_attention"] * 6
    types[2] = types[5] = "full_attention"
    cfg = AutoConfig.for_model("gemma3_text", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=window,
                               layer_types=types, max_position_embeddings=context)
    return byte_budget(cfg, GDNConfig(), fraction, context, torch.float32)


def test_byte_budget_goes_to_the_top_global_layer_and_counts_windows():
    """A global layer costs its whole context, a sliding one its window: at a budget that fits one global layer the
    top-scoring global layer (5) is kept, not the next one (2), and the budget still keeps every sliding layer; the
    old count budget at the same fraction keeps both global layers, far more bytes."""
    budget = _windowed_budget(0.6)
    kib = 1024
    gdn = 4 * 16 * 16 * 4 + 3 * 64 * 3 * 4  # 4 GDN heads: fp32 state + conv inputs
    assert budget.layer_costs()[5] == (1024 * 16 * 2 * 4, gdn) and budget.layer_costs()[0] == (64 * 16 * 2 * 4, gdn)
    assert budget.teacher == 2 * 128 * kib + 4 * 8 * kib
    scores = [0.9, 0.1, 0.5, 0.2, 0.3, 0.8]  # sliding layer 0 first, then global 5, then global 2
    kept = kept_layers("retrieval", 6, 4, scores, kv_budget=budget)
    assert kept == [0, 1, 3, 4, 5]
    spent = sum(budget.layer_costs()[i][0 if i in kept else 1] for i in range(6))
    assert spent <= budget.limit < spent + 128 * kib - gdn  # the second global layer would not fit
    assert kept_layers("retrieval", 6, 4, scores, kv_budget=0.6) == [0, 2, 5]  # by count: both global layers


def test_byte_budget_keeps_windows_smaller_than_a_gdn_state():
    """A sliding layer whose window caches fewer bytes than a GDN state saves nothing converted: it stays attention
    whatever its score; a budget too small for any global layer keeps those alone."""
    budget = _windowed_budget(0.3, window=16)  # a 16-token window: 2 KiB of KV against a GDN state of 6.25 KiB
    assert all(a < g for i, (a, g) in budget.layer_costs().items() if i not in (2, 5))
    assert kept_layers("bypass", 6, 4, [0.0, 0.0, 1.0, 0.0, 0.0, 0.9], kv_budget=budget) == [0, 1, 3, 4]


def test_byte_budget_errors_name_the_floor():
    import pytest as _pytest

    from taylor_calibrate.policy import kept_groups_of

    with _pytest.raises(ValueError, match="below the least any hybrid"):
        kept_layers("retrieval", 6, 4, [0.0] * 6, kv_budget=_windowed_budget(0.05))
    with _pytest.raises(ValueError, match="fits no attention"):  # the GDN states fit, no global layer does
        import torch

        kept_groups_of(torch.zeros(6, 1), 4, _windowed_budget(0.15, window=1024))


def test_uniform_under_a_byte_budget_spreads_the_most_layers_that_fit():
    budget = _windowed_budget(0.6)
    kept = kept_layers("uniform", 6, 4, kv_budget=budget)
    costs = budget.layer_costs()
    assert sum(costs[i][0 if i in kept else 1] for i in range(6)) <= budget.limit and kept[0] == 0
    assert kept == [0, 1, 2, 3, 4]  # five spread hold one global layer (2) and four windows: it fits
    assert kept_layers("uniform", 6, 4, kv_budget=_windowed_budget(0.5)) == [0, 1, 3, 4]  # four: no global layer


def test_smollm2_byte_budget_against_the_count_budget():
    """On SmolLM2-135M's shape (30 uniform layers, 9 query / 3 KV heads of 64, no window) at 8K: in fp32 a 25% byte
    budget keeps the same 7 layers as the old 25% of the layers, but the converted layers' GDN states tip the
    head-wise choice from 22 KV groups to 21; in bf16 (half the KV bytes, the same fp32 state) 6 layers and 20."""
    import torch
    from transformers import AutoConfig

    from taylor_calibrate.config import GDNConfig
    from taylor_calibrate.memory import byte_budget
    from taylor_calibrate.policy import kept_groups_of

    cfg = AutoConfig.for_model("llama", vocab_size=97, hidden_size=576, intermediate_size=96, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                               max_position_embeddings=8192)
    scores = [((i * 7) % 30) / 30 for i in range(30)]
    groups = torch.tensor([[((i * 3 + g) * 11 % 90) / 90 for g in range(3)] for i in range(30)])
    for dtype, layers, kept_g in ((torch.float32, 7, 21), (torch.bfloat16, 6, 20)):
        budget = byte_budget(cfg, GDNConfig(), 0.25, None, dtype)
        assert budget.context == 8192
        by_bytes = kept_layers("bypass", 30, 4, scores, kv_budget=budget)
        assert len(by_bytes) == layers and set(by_bytes) <= set(kept_layers("bypass", 30, 4, scores, kv_budget=0.25))
        assert sum(map(len, kept_groups_of(groups, 4, budget).values())) == kept_g
        assert sum(map(len, kept_groups_of(groups, 4, 0.25).values())) == 22
    assert kept_layers("bypass", 30, 4, scores) == kept_layers("bypass", 30, 4, scores, kv_budget=None)  # keep_every


def test_knockouts_reorder_the_groups_the_answer_needs_first():
    """Gemma 3's case: one layer looks at the needle most, another one is what the answer needs. The knocked-out
    group that costs the answer most ranks first; a candidate whose knockout costs nothing keeps its mass rank."""
    from taylor_calibrate.policy import causal_scores, knockout_candidates

    mass = torch.tensor([[0.02], [1.6], [0.17], [0.66], [0.001]])
    assert knockout_candidates(mass) == [(1, 0), (3, 0), (2, 0)]  # >= 10% of the top, largest first
    assert knockout_candidates(mass, limit=2) == [(1, 0), (3, 0)]
    scores = causal_scores(mass, {(1, 0): 3.9, (3, 0): 14.9, (2, 0): 0.0})
    assert rank_order({i: float(scores[i, 0]) for i in range(5)}) == [3, 1, 2, 0, 4]
    assert knockout_candidates(torch.zeros(3, 2)) == []

