"""What the toolkit needs to know about a linear mixer, gathered in one small dataclass per mixer.

A mixer's module is called like the teacher's attention, `mixer(hidden_states, cache=..., gdn_mask=...) ->
(out, None)`, and exposes the three steps of that call, which phase 1, phase 2 and distillation use on their own:

    features(x, cache=None, gdn_mask=None) -> tuple of (B, T, ...) tensors, the recurrence's inputs
    readout(*features, cache=None)         -> (B, T, H, D), the recurrence; holds no parameters (phase 2 runs it
                                              once on every layer's features stacked along the batch)
    output(x, o)                           -> (B, T, hidden), gate and output projection

and the attributes `num_heads`, `head_dim`, `layer_idx`, `backend` (set by the model) and `o_proj`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn


@dataclass(frozen=True)
class MixerSpec:
    name: str
    """Key in `MIXERS`, in `HybridConfig.mixer`, and the config key its options are stored under."""
    config: type
    """Options dataclass (built from the stored dict with `config.from_dict`, stored with `dataclasses.asdict`)."""
    module: type[nn.Module]
    """The layer class."""
    build: Callable[..., nn.Module]
    """build(hidden_size, num_heads, head_dim, options, layer_idx, qkv_bias, o_bias) -> a new layer."""
    copy_from_attention: Callable[[nn.Module, nn.Module, int], None]
    """copy_from_attention(mixer, attn, num_kv_heads): the weight transfer from the teacher's attention."""
    init_weights: Callable[[nn.Module, Any], None]
    """init_weights(mixer, torch.Generator): the library-default init of the parameters attention does not have."""
    calibrators: dict[str, Callable]
    """Phase 1 by method ("copy", "zero_gate", "paper", "taylor", ...): f(mixer, layer stats, inputs, head outputs,
    CalibArgs) -> report, the mixer set in place."""
    param_groups: dict[str, str]
    """Phase 2 optimizer group of every top-level parameter / submodule name: "qkv", "dynamics", "new", "o_proj" or
    "o_norm" (AlignArgs' learning rates)."""
    state_bytes: Callable[[Any, int, int, int], int]
    """state_bytes(options, num_heads, head_dim, element_size): bytes of the decoding state (recurrent + conv) of
    `num_heads` heads of one layer for one sequence, from the options alone (budgets count it before any layer
    exists)."""
    kernels: dict = field(default_factory=dict)
    """{(backend, mode): kernel} of the recurrence; backend "torch" is the reference."""
    exports: dict[str, Any] = field(default_factory=dict)
    """Export formats this mixer maps onto (e.g. "qwen3_5"), each the format's own description."""

    def options(self, stored: dict | None):
        """The options dataclass from what a config stores."""
        return self.config.from_dict(stored)

    def export(self, fmt: str):
        """This mixer's description for export format `fmt`, or a clear error where it maps onto none."""
        if fmt not in self.exports:
            raise ValueError(f"the {self.name!r} mixer has no {fmt} form (its exports: {sorted(self.exports) or 'none'})"
                             f"; convert with a mixer that has one, or add it to the mixer's spec (`exports`)")
        return self.exports[fmt]
