"""Linear mixers a converted layer can become, one folder each, registered here by name (`HybridConfig.mixer`).

A new mixer is a folder with its layer, options, phase-1 calibrators and a `MixerSpec` (model/mixers/spec.py), plus
one line in MIXERS.
"""
from __future__ import annotations

import torch.nn as nn

from taylor_calibrate.model.mixers.gdn import GDN_SPEC
from taylor_calibrate.model.mixers.spec import MixerSpec

MIXERS: dict[str, MixerSpec] = {"gdn": GDN_SPEC}


def get_spec(name: str) -> MixerSpec:
    """The registered mixer `name`, or a clear error naming the known ones."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; known: {', '.join(MIXERS)}")
    return MIXERS[name]


def spec_of(module: nn.Module) -> MixerSpec:
    """The spec of a mixer layer, by its class."""
    for spec in MIXERS.values():
        if isinstance(module, spec.module):
            return spec
    raise ValueError(f"{type(module).__name__} is not a registered mixer layer; known: {', '.join(MIXERS)}")


def spec_for_options(options) -> MixerSpec:
    """The spec whose options dataclass `options` is (what a caller passing e.g. a GDNConfig means)."""
    for spec in MIXERS.values():
        if isinstance(options, spec.config):
            return spec
    raise ValueError(f"{type(options).__name__} is not the options of a registered mixer; known: {', '.join(MIXERS)}")


__all__ = ["MIXERS", "MixerSpec", "get_spec", "spec_of", "spec_for_options"]
