"""The `kl` and `combined` layer policies (docs/method.md, "Layer policies"): `kl` ranks layers by how much restoring
each alone to attention lowers the all-GDN hybrid's KL to the teacher; `combined` mixes those scores with the
`retrieval` policy's, each scaled to [0, 1], by --policy_weight."""
import json
import math
import random
import re

import pytest
import torch
from conftest import one_thread, tiny_local_teacher, tiny_teacher

from taylor_calibrate.experiments.ablate import check_policies
from taylor_calibrate.cli import main
from taylor_calibrate.config import ConvertArgs, GDNConfig
from taylor_calibrate.model.hybrid import make_mixers
from taylor_calibrate.policy import combined_scores, kept_layers, kl_scores

pytestmark = pytest.mark.usefixtures("single_thread")


def _teacher(layers=2):
    return tiny_teacher("llama", num_hidden_layers=layers, initializer_range=0.2)


def _tokens(model, n=3, t=24):
    return torch.randint(0, model.config.vocab_size, (n, t), generator=torch.Generator().manual_seed(0))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _direct_kl(model, mixers, ids, gdn):
    """KL(teacher || hybrid) in nats per position, the layers `gdn` swapped by hand."""
    layers = model.model.layers
    p = _logits(model, ids)
    saved = {i: layers[i].self_attn for i in gdn}
    for i in gdn:
        layers[i].self_attn = mixers[i]
    q = _logits(model, ids)
    for i, a in saved.items():
        layers[i].self_attn = a
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


def test_kl_score_is_the_kl_drop_of_restoring_the_layer():
    model = _teacher(2)
    ids = _tokens(model)  # 3 rows in batches of 2: the sum runs over uneven batches
    mixers = make_mixers(model, [0, 1], GDNConfig())
    before, modules = _logits(model, ids), [layer.self_attn for layer in model.model.layers]
    scores = kl_scores(model, mixers, ids, batch_size=2)
    all_gdn = _direct_kl(model, mixers, ids, [0, 1])
    assert all_gdn > 1e-3
    for i in (0, 1):
        restored = _direct_kl(model, mixers, ids, [1 - i])
        assert scores[i] == pytest.approx(all_gdn - restored, rel=1e-4, abs=1e-6)
    assert scores[0] != pytest.approx(scores[1])
    # the teacher is left as it was
    assert all(layer.self_attn is m for layer, m in zip(model.model.layers, modules))
    assert torch.equal(_logits(model, ids), before)


def test_kl_keeps_the_layer_whose_mixer_breaks_the_hybrid():
    """A non-finite hybrid counts as KL 1e30: restoring the broken layer wins; the others score 0."""
    model = _teacher(4)
    mixers = make_mixers(model, list(range(4)), GDNConfig())
    with torch.no_grad():
        mixers[2].o_proj.weight.fill_(math.nan)
    scores = kl_scores(model, mixers, _tokens(model), batch_size=3)
    assert scores[2] > 1e29 and scores[:2] + scores[3:] == [0.0] * 3
    assert kept_layers("kl", 4, 4, scores) == [2]


def test_kl_needs_a_mixer_for_every_layer():
    model = _teacher(2)
    with pytest.raises(ValueError, match="a phase-1 mixer for every layer"):
        kl_scores(model, make_mixers(model, [1], GDNConfig()), _tokens(model))


def test_kl_scores_are_deterministic():
    model = _teacher(4)
    ids = _tokens(model)
    mixers = make_mixers(model, list(range(4)), GDNConfig())
    first, second = (kl_scores(model, mixers, ids, batch_size=2) for _ in range(2))
    assert first == second
    retrieval = [0.3, 2.0, 0.1, 1.2]
    for w in (0.0, 0.3, 1.0):
        assert combined_scores(first, retrieval, w) == combined_scores(second, retrieval, w)
        assert kept_layers("combined", 4, 2, combined_scores(first, retrieval, w)) == \
            kept_layers("combined", 4, 2, combined_scores(second, retrieval, w))


def test_combined_weights_zero_and_one_are_kl_and_retrieval():
    """Also with near-equal scores (ties at SCORE_RESOLUTION), at every budget: the ends are exactly the two
    policies' choices."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 12)
        kl = [round(rng.uniform(-1, 3), 2) + rng.choice([0, 1e-4, -1e-4, 4e-3]) for _ in range(n)]
        retrieval = [rng.choice([0.0, 0.5, rng.uniform(0, 8)]) for _ in range(n)]
        for budget in (None, 0.3, 0.5):
            for every in (2, 3):
                if budget is None and len(range(0, n, every)) == n:
                    continue
                want_kl = kept_layers("kl", n, every, kl, budget)
                want_retrieval = kept_layers("retrieval", n, every, retrieval, budget)
                assert kept_layers("combined", n, every, combined_scores(kl, retrieval, 0.0), budget) == want_kl
                assert kept_layers("combined", n, every, combined_scores(kl, retrieval, 1.0), budget) \
                    == want_retrieval


def test_combined_scales_each_score_to_the_unit_interval():
    # kl in nats, retrieval in attention mass: min-max puts each on [0, 1] before mixing
    assert combined_scores([0.0, 0.5, 1.0], [4.0, 0.0, 2.0], 0.5) == pytest.approx([0.5, 0.25, 0.75])
    assert combined_scores([0.2, 0.2], [1.0, 3.0], 0.25) == pytest.approx([0.0, 0.25])  # a flat score counts 0
    with pytest.raises(ValueError, match="one kl and one retrieval score per layer"):
        combined_scores([0.1, 0.2], [1.0], 0.5)


@pytest.mark.parametrize("weight", ["-0.1", "1.5"])
def test_bad_policy_weight_is_a_clear_error(weight, capsys, tmp_path):
    assert main(["convert", "--policy", "combined", "--policy_weight", weight, "--out", str(tmp_path / "o"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and re.search(r"policy_weight=.* must be in \[0, 1\]", err), err
    assert "Traceback" not in err
    with pytest.raises(ValueError, match=r"policy_weight=nan must be in \[0, 1\]"):  # YAML can say .nan
        ConvertArgs(policy_weight=math.nan)


def test_ablate_takes_kl_and_says_combined_is_convert_only():
    check_policies(["uniform", "kl", "layers=0,2"])
    with pytest.raises(ValueError, match="only convert builds: run `taylor-calibrate convert --policy combined`"):
        check_policies(["kl", "combined"])


def _convert(teacher, corpus, out, *flags):
    with one_thread():
        assert main(["convert", "--teacher", str(teacher), "--out", str(out), "--device", "cpu", "--backend", "torch",
                     "--data.source", str(corpus), "--data.seq_len", "32", "--data.calib_seqs", "4",
                     "--data.eval_seqs", "2", "--phase2.steps", "2", "--phase2.batch_size", "2",
                     "--probe_samples", "1", "--keep_every", "2", *flags]) == 0
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def local_teacher(tmp_path_factory):
    return tiny_local_teacher(tmp_path_factory.mktemp("kl"), max_position_embeddings=1024)


def test_convert_policy_kl_end_to_end(local_teacher, tmp_path, capsys):
    report = _convert(*local_teacher, tmp_path / "a", "--policy", "kl")
    assert "policy kl: 5 hybrid passes (and 1 teacher pass) over 128 calibration tokens" in capsys.readouterr().out
    n = len(report["layer_types"])
    assert report["policy"] == "kl" and len(report["policy_scores"]) == n
    assert report["kept_layers"] == kept_layers("kl", n, 2, report["policy_scores"])
    assert sorted(report["kept_layers"] + report["gdn_layers"]) == list(range(n))
    assert sorted(int(k) for k in report["phase2"]["layers"]) == report["gdn_layers"]
    again = _convert(*local_teacher, tmp_path / "b", "--policy", "kl")
    assert again["policy_scores"] == report["policy_scores"] and again["kept_layers"] == report["kept_layers"]


@pytest.mark.parametrize("weight, alone", [("0", "kl"), ("1", "retrieval")])
def test_convert_policy_combined_end_to_end(local_teacher, tmp_path, weight, alone):
    report = _convert(*local_teacher, tmp_path / "a", "--policy", "combined", "--policy_weight", weight)
    scores, n = report["policy_scores"], len(report["layer_types"])
    assert set(scores) == {"kl", "retrieval", "weight", "combined"} and scores["weight"] == float(weight)
    assert all(len(scores[k]) == n for k in ("kl", "retrieval", "combined"))
    assert report["kept_layers"] == kept_layers(alone, n, 2, scores[alone])
    assert report["kept_layers"] == kept_layers("combined", n, 2, scores["combined"])
    again = _convert(*local_teacher, tmp_path / "b", "--policy", "combined", "--policy_weight", weight)
    assert again["kept_layers"] == report["kept_layers"] and again["policy_scores"] == scores
    own = _convert(*local_teacher, tmp_path / "c", "--policy", alone)  # the policy alone, from its own run
    own_scores = own["policy_scores"] if alone == "kl" else [sum(g) for g in own["policy_scores"]]
    assert own["kept_layers"] == report["kept_layers"] and own_scores == pytest.approx(scores[alone], abs=1e-6)
