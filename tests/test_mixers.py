"""Every registered mixer spec is complete: its layer's parameters all have a phase-2 group, its options round-trip
through the stored dict, it has the copy baseline and a reference kernel. The toy (tests/toy_mixer) is held to the
same rules."""
import dataclasses

import pytest
import torch
from toy_mixer import TOY_SPEC

from taylor_calibrate.model.mixers import MIXERS, get_spec, spec_of
from taylor_calibrate.model.mixers.gdn import GDNConfig

SPECS = {**MIXERS, "toy": TOY_SPEC}
OPTIONS = {"gdn": [GDNConfig(), GDNConfig(short_conv="none", gate="none", output_norm=False, bias=False)],
           "toy": [TOY_SPEC.config()]}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_is_complete(name):
    spec = SPECS[name]
    assert spec.name == name and "copy" in spec.calibrators
    assert any(backend == "torch" for backend, _ in spec.kernels), "a reference kernel on the torch backend"
    for options in OPTIONS[name]:
        assert spec.options(dataclasses.asdict(options)) == options
        layer = spec.build(64, 4, 16, options, 0, qkv_bias=True, o_bias=True)
        assert isinstance(layer, spec.module)
        tops = {n.split(".")[0] for n, _ in layer.named_parameters()}
        assert tops <= set(spec.param_groups), f"parameters without a phase-2 group: {tops - set(spec.param_groups)}"
        assert set(spec.param_groups.values()) <= {"qkv", "dynamics", "new", "o_proj", "o_norm"}
        x = torch.randn(2, 5, 64)
        feats = layer.features(x)
        out = layer.output(x, layer.readout(*feats))
        torch.testing.assert_close(out, layer(x)[0])
        assert spec.state_bytes(options, 4, 16, 4) > 0


def test_lookup_errors_name_the_known_mixers():
    assert get_spec("gdn") is MIXERS["gdn"]
    with pytest.raises(ValueError, match="unknown mixer 'kda'; known: gdn"):
        get_spec("kda")
    with pytest.raises(ValueError, match="not a registered mixer layer"):
        spec_of(torch.nn.Linear(2, 2))
