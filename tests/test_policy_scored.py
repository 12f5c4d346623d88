"""Scored layer policies (docs/method.md, "Layer policies"): `bypass` ranks layers by the damage of skipping their
attention, `greedy` by the perplexity of the hybrid that keeps only that layer; both keep the top ceil(n / keep_every),
sorted."""
import math

import pytest
import torch
from conftest import tiny_teacher

from taylor_calibrate.config import GDNConfig
from taylor_calibrate.evaluate import perplexity
from taylor_calibrate.model.hybrid import make_mixers, swapped_into
from taylor_calibrate.policy import bypass_scores, greedy_scores, kept_layers

N_LAYERS = 4


pytestmark = pytest.mark.usefixtures("single_thread")


def _teacher():
    return tiny_teacher("llama", initializer_range=0.2)  # weights large enough that every layer matters


def _tokens(model, n=3, t=24):
    return torch.randint(0, model.config.vocab_size, (n, t), generator=torch.Generator().manual_seed(0))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _attention_modules(model):
    return [layer.self_attn for layer in model.model.layers]


# ----------------------------------------------------------------------------- bypass


def test_bypass_scores_measure_the_damage_of_skipping_attention():
    model = _teacher()
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()  # layer 2's attention already contributes nothing
    ids = _tokens(model)
    before, modules = _logits(model, ids), _attention_modules(model)
    scores = bypass_scores(model, ids, batch_size=2)
    assert len(scores) == N_LAYERS and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert abs(scores[2]) < 1e-6
    assert all(abs(s) > 1e-3 for i, s in enumerate(scores) if i != 2), scores
    # the teacher is left as it was: same modules, no hooks, same logits
    assert all(a is b for a, b in zip(_attention_modules(model), modules))
    assert all(not m._forward_hooks for m in _attention_modules(model))
    assert torch.equal(_logits(model, ids), before)


def test_bypass_score_is_the_nll_increase():
    model = _teacher()
    ids = _tokens(model)
    scores = bypass_scores(model, ids, batch_size=3)
    base = perplexity(model, ids, 3)["nll"]
    with torch.no_grad():  # skipping attention = a zero attention output = zero o_proj (llama has no o_proj bias)
        w = model.model.layers[1].self_attn.o_proj.weight
        saved = w.clone()
        w.zero_()
        skipped = perplexity(model, ids, 3)["nll"]
        w.copy_(saved)
    assert scores[1] == pytest.approx(skipped - base, abs=1e-6)


# ----------------------------------------------------------------------------- kept_layers on scores


@pytest.mark.parametrize("policy", ["bypass", "greedy"])
def test_scored_policies_keep_the_top_layers_sorted(policy):
    scores = [0.1, 5.0, 3.0, -1.0, 7.0, 0.0, 2.0, 9.0, 1.0, 4.0]
    assert kept_layers(policy, 10, 4, scores) == [1, 4, 7]  # ceil(10 / 4) = 3 best: 9 (7), 7 (4), 5 (1)
    assert kept_layers(policy, 10, 2, scores) == [1, 2, 4, 7, 9]
    assert kept_layers(policy, 10, 10, scores) == [7]
    assert kept_layers(policy, 10, 4, [0.0] * 10) == [0, 1, 2]  # ties: lower layers first, deterministically
    assert kept_layers(policy, 10, 4, [-1e30] * 9 + [-5.0]) == [0, 1, 9]


@pytest.mark.parametrize("policy", ["bypass", "greedy"])
@pytest.mark.parametrize("scores", [None, [1.0, 2.0, 3.0], [1.0] * 11, []])
def test_scored_policies_need_one_score_per_layer(policy, scores):
    with pytest.raises(ValueError, match=f"policy '{policy}' needs one score per layer \\(10\\)"):
        kept_layers(policy, 10, 4, scores)


def test_scored_policy_keeping_every_layer_is_an_error():
    with pytest.raises(ValueError, match="nothing would be converted"):
        kept_layers("bypass", 4, 1, [1.0, 2.0, 3.0, 4.0])


# ----------------------------------------------------------------------------- greedy


def test_greedy_scores_restore_the_teacher():
    model = _teacher()
    ids = _tokens(model)
    mixers = make_mixers(model, list(range(N_LAYERS)), GDNConfig())
    before, modules = _logits(model, ids), _attention_modules(model)
    scores = greedy_scores(model, mixers, ids, batch_size=2)
    assert len(scores) == N_LAYERS and all(math.isfinite(s) for s in scores)
    assert len(set(scores)) == N_LAYERS, "every layer kept alone gives a different hybrid"
    assert all(a is b for a, b in zip(_attention_modules(model), modules))
    assert not any(m in _attention_modules(model) for m in mixers.values())
    assert torch.equal(_logits(model, ids), before)
    # score i = minus the NLL of the hybrid that keeps only layer i as attention
    with swapped_into(model, {j: m for j, m in mixers.items() if j != 2}):
        assert scores[2] == pytest.approx(-perplexity(model, ids, 2)["nll"], abs=1e-6)


def test_greedy_never_prefers_a_non_finite_hybrid():
    """A mixer that makes the hybrid NaN: every hybrid containing it scores -1e30; keeping its layer wins."""
    model = _teacher()
    ids = _tokens(model)
    mixers = make_mixers(model, list(range(N_LAYERS)), GDNConfig())
    with torch.no_grad():
        mixers[3].o_proj.weight.fill_(math.nan)
    scores = greedy_scores(model, mixers, ids, batch_size=3)
    assert scores[:3] == [-1e30] * 3 and math.isfinite(scores[3]) and scores[3] > -1e30
    assert kept_layers("greedy", N_LAYERS, 4, scores) == [3]


def test_greedy_restores_the_teacher_when_a_hybrid_fails():
    class Broken(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError("broken mixer")

    model = _teacher()
    modules = _attention_modules(model)
    mixers = {i: Broken() for i in range(N_LAYERS)}
    with pytest.raises(RuntimeError, match="broken mixer"):
        greedy_scores(model, mixers, _tokens(model), batch_size=3)
    assert all(a is b for a, b in zip(_attention_modules(model), modules))
