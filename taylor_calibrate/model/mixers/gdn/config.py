"""Options of a converted Gated DeltaNet layer (docs/method.md, "The GDN layer")."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar


@dataclass
class GDNConfig:
    """Options of a converted Gated DeltaNet layer (docs/method.md, "The GDN layer").

    Head count and head dim are not options: they are the teacher's (num_heads = query heads, expand_v = 1).
    """
    RANGES: ClassVar[dict[str, str]] = {"conv_size": "[2, 16]", "norm_eps": "(0, 1)"}  # `config.check_options`

    short_conv: str = "random"
    """Short causal depthwise conv on q/k/v (fla's `use_short_conv`, on by default there) and its library init, which
    the `copy` / `zero_gate` baselines keep: "random" (fla's: nn.Conv1d's default), "identity", or "none" (no conv:
    SiLU on q/k/v, as the reference). `taylor` sets the convs itself (v: the teacher's local attention profile, q/k:
    identity; --calib.local_profile), `paper` to identity (the reference's conv-free layer at step 0). The convs carry
    the local part of the attention pattern that a RoPE-free recurrence cannot (docs/decisions.md, "short conv")."""
    conv_size: int = 4
    """Kernel size of the short convolution."""
    qk_activation: str = "silu"
    """Activation on q and k before L2 normalisation: "silu" (fla) or "identity"."""
    v_activation: str = "identity"
    """Activation on v: "identity" (keeps the copied values linear, as attention mixes them; docs/decisions.md,
    "v activation") or "silu" (fla's layer)."""
    qk_norm: str = "fold"
    """The teacher's per-head q/k RMSNorm (Qwen3, Gemma 3) in the weight transfer: "fold" (its per-channel factor
    into the copied q/k projections, so the L2-normalised q and k point where the teacher's normed ones do) or "drop"
    (left out: the L2 normalisation stands in for the norm's scale alone; docs/decisions.md, "Teacher q/k norms")."""
    output_norm: bool = True
    """Per-head RMSNorm on the recurrent readout before the gate (fla's o_norm)."""
    gate: str = "swish"
    """Output gate form: "swish" (fla), "sigmoid", or "none" (no g_proj)."""
    norm_eps: float = 1e-5
    """Epsilon of the per-head RMSNorm."""
    bias: bool = True
    """Carry the teacher's q/k/v/o projection biases (Qwen2's q/k/v) into the GDN layer; `--target qwen3_5` turns
    this off (Qwen3.5's GDN has no biases)."""

    def __post_init__(self):
        choices = {"short_conv": ("none", "identity", "random"), "qk_activation": ("silu", "identity"),
                   "v_activation": ("silu", "identity"), "gate": ("swish", "sigmoid", "none"),
                   "qk_norm": ("fold", "drop")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GDN option {name}={getattr(self, name)!r} is not one of {allowed}")
        if not 2 <= self.conv_size <= 16:
            raise ValueError(f"GDN option conv_size={self.conv_size} must be in [2, 16]")
        if not self.norm_eps > 0:
            raise ValueError(f"GDN option norm_eps={self.norm_eps} must be > 0 (e.g. 1e-5)")

    @classmethod
    def from_dict(cls, d: dict | None) -> "GDNConfig":
        """The options a hybrid's config stores; one it predates reads as what the code did before it existed."""
        d = {**PREDATED, **(d or {})}
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown GDN option(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


PREDATED = {"qk_norm": "drop"}
"""Options added after hybrids were first saved, with what a hybrid saved without them was converted with (the q/k
norm fold came in with the option: a stored config that lacks it was converted by dropping the norms)."""
