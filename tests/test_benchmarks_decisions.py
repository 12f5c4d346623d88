"""benchmarks/decisions.py's own code: the hybrid-input capture of the "student inputs" variants and the --only
check (the variants' results are benchmark output, not tests)."""
import sys

import pytest
import torch

from taylor_calibrate import GDNConfig, convert_teacher
from taylor_calibrate.stats import collect_stats
from conftest import load_benchmark, tiny_teacher

pytestmark = pytest.mark.usefixtures("single_thread")


def test_hybrid_inputs_are_the_teachers_up_to_the_first_converted_layer_and_drift_after():
    decisions = load_benchmark("decisions")
    teacher = tiny_teacher("llama")
    ids = torch.randint(0, teacher.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    layers = [1, 2]
    stats = collect_stats(teacher, ids, store_layers=layers, batch_size=2)
    mixers = convert_teacher(teacher, layers, GDNConfig()).gdn_mixers
    got = decisions.hybrid_inputs(teacher, mixers, ids, batch_size=2, device=torch.device("cpu"))
    assert set(got) == set(layers) and got[1].shape == stats.inputs[1].shape
    torch.testing.assert_close(got[1], stats.inputs[1])  # nothing before layer 1 changed
    assert not torch.allclose(got[2], stats.inputs[2], atol=1e-3)  # layer 1's GDN output feeds layer 2
    assert teacher.model.layers[1].self_attn is not mixers[1]  # the teacher's attention is back in place


def test_unknown_variant_names_fail_with_the_names(monkeypatch, capsys):
    decisions = load_benchmark("decisions")
    monkeypatch.setattr(sys, "argv", ["decisions.py", "--only", "taylor (default);no such variant"])
    with pytest.raises(SystemExit):
        decisions.main()
    assert "no such variant" in capsys.readouterr().err
