"""Configs: the GDN mixer's options, the hybrid model's HF config, and the CLI's argument dataclasses.

Everything a user can set is a field of a dataclass here; the CLI (jsonargparse) and YAML files both fill
them, and the field docstrings become `--help`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from transformers import PreTrainedConfig

from taylor_calibrate.data import CorpusSpec

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")

ATTENTION_TYPES = ("full_attention", "sliding_attention")
GDN_TYPE = "linear_attention"  # transformers' cache name for a recurrent-state layer


@dataclass
class GDNConfig:
    """Options of a converted Gated DeltaNet layer (METHOD.md sections 2 and 7).

    Head count and head dim are not options: they are the teacher's (num_heads = query heads, expand_v = 1).
    """

    short_conv: str = "none"
    """Short causal conv on q/k/v: "none" (SiLU on q/k/v, as the reference), "identity" (identity-initialised
    depthwise conv then SiLU, fla-compatible), "random" (fla's default init)."""
    conv_size: int = 4
    """Kernel size of the short convolution."""
    qk_activation: str = "silu"
    """Activation on q and k before L2 normalisation: "silu" (fla) or "identity"."""
    v_activation: str = "silu"
    """Activation on v: "silu" (fla) or "identity" (keeps the teacher's values exactly)."""
    output_norm: bool = True
    """Per-head RMSNorm on the recurrent readout before the gate (fla's o_norm)."""
    gate: str = "swish"
    """Output gate form: "swish" (fla), "sigmoid", or "none" (no g_proj)."""
    norm_eps: float = 1e-5
    """Epsilon of the per-head RMSNorm."""

    def __post_init__(self):
        choices = {"short_conv": ("none", "identity", "random"), "qk_activation": ("silu", "identity"),
                   "v_activation": ("silu", "identity"), "gate": ("swish", "sigmoid", "none")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GDN option {name}={getattr(self, name)!r} is not one of {allowed}")
        if not 2 <= self.conv_size <= 16:
            raise ValueError(f"GDN option conv_size={self.conv_size} must be in [2, 16]")

    @classmethod
    def from_dict(cls, d: dict | None) -> "GDNConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown GDN option(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


# Attributes of the teacher config that generation, masking and caching read from the top-level config.
_MIRRORED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "max_position_embeddings", "sliding_window", "rms_norm_eps", "bos_token_id",
             "eos_token_id", "pad_token_id", "final_logit_softcapping")


class HybridConfig(PreTrainedConfig):
    """HF config of a hybrid: the teacher's own config plus which layers are GDN.

    `layer_types` uses transformers' names ("full_attention", "sliding_attention", "linear_attention"), so
    `DynamicCache(config=...)` builds KV layers for kept attention and recurrent-state layers for GDN.
    """

    model_type = "taylor_hybrid"

    base_config: dict | None = None
    layer_types: list[str] | None = None
    gdn: dict | None = None
    teacher_name: str | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        base = self.base_config or {}
        for key in _MIRRORED:
            if key in base:
                setattr(self, key, base[key])
        if "tie_word_embeddings" in base:
            self.tie_word_embeddings = base["tie_word_embeddings"]
        super().__post_init__(**kwargs)

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types or []) if t == GDN_TYPE]

    @property
    def gdn_config(self) -> GDNConfig:
        return GDNConfig.from_dict(self.gdn)


def gdn_dict(cfg: GDNConfig) -> dict:
    return asdict(cfg)


@dataclass
class DataArgs(CorpusSpec):
    """Which text to calibrate on and which to evaluate on (never overlapping documents)."""

    seq_len: int = 1024
    """Tokens per sequence, for calibration and evaluation."""
    calib_seqs: int = 16
    """Number of calibration sequences."""
    eval_seqs: int = 32
    """Number of held-out sequences for perplexity."""

    def __post_init__(self):
        for name in ("seq_len", "calib_seqs", "eval_seqs"):
            if getattr(self, name) < (2 if name == "seq_len" else 1):
                raise ValueError(f"data option {name}={getattr(self, name)} is out of range (must be positive)")


@dataclass
class ConvertArgs:
    """`taylor-calibrate convert`: teacher -> hybrid."""

    teacher: str = "smollm2-135m"
    """HF checkpoint directory, hub id, .gguf file, or "smollm2-135m" (the embedded default teacher)."""
    out: str = "out/hybrid"
    """Output directory (model, tokenizer, report.json)."""
    init: str = "copy"
    """Initialisation of the GDN layers: "copy" (weight copy, library-default dynamics)."""
    policy: str = "uniform"
    """Which layers stay softmax attention: "uniform" (every k-th from 0) or "layers=0,4,8" (explicit list)."""
    keep_every: int = 4
    """For the uniform policy: keep one attention layer in this many."""
    gdn: GDNConfig = field(default_factory=GDNConfig)
    data: DataArgs = field(default_factory=DataArgs)
    backend: str = "auto"
    """GDN kernels: "auto" (fla when CUDA and fla are present, else torch), "torch", or "fla"."""
    device: str = "auto"
    """"auto" (cuda if available), "cpu", or "cuda"."""
    dtype: str = "auto"
    """Compute dtype: "auto" (bf16 on cuda, fp32 on cpu), "float32", "bfloat16"."""
    eval_batch_size: int = 4
    """Sequences per forward pass during evaluation."""
    seed: int = 0
    """Seed of the random parts of the initialisation."""


@dataclass
class EvalArgs:
    """`taylor-calibrate eval`: perplexity of a hybrid (and optionally its teacher) on held-out text."""

    model: str = "out/hybrid"
    """A hybrid output directory (or any causal LM checkpoint)."""
    teacher: str | None = None
    """Also evaluate this teacher in the same run (same text, same tokenizer)."""
    out: str | None = None
    """Where to write report.json (default: <model>/eval)."""
    data: DataArgs = field(default_factory=DataArgs)
    backend: str = "auto"
    """GDN kernels: "auto", "torch" or "fla"."""
    device: str = "auto"
    dtype: str = "auto"
    eval_batch_size: int = 4
