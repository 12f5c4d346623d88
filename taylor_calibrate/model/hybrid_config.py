"""The hybrid's HF config (transformers' `configuration_*` role): the teacher's own config plus which layers are
linear mixers, and which mixer. Imports nothing of ours, so the mixers, the model and the CLI all read it."""
from __future__ import annotations

from transformers import PreTrainedConfig

ATTENTION_TYPES = ("full_attention", "sliding_attention")
MIXER_TYPE = "linear_attention"  # transformers' cache name for a recurrent-state layer
# transformers' cache names for a layer that holds both: a KV cache (of the kept heads) and a recurrent state
HEADWISE_TYPES = {"full_attention": "hybrid", "sliding_attention": "hybrid_sliding"}

def cached_layer_types(config) -> list[str]:
    """Cache kind of every layer of a teacher (or hybrid) config: its `layer_types`, or, without them, every layer
    "sliding_attention" when the config has a `sliding_window` (Mistral), else "full_attention" (transformers'
    DynamicCache reads a config the same way)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * config.num_hidden_layers


# Attributes of the teacher config that generation, masking and caching read from the top-level config.
_MIRRORED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "max_position_embeddings", "sliding_window", "rms_norm_eps", "bos_token_id",
             "eos_token_id", "pad_token_id", "final_logit_softcapping")


class HybridConfig(PreTrainedConfig):
    """HF config of a hybrid: the teacher's own config plus which layers are linear mixers.

    `layer_types` uses transformers' names ("full_attention", "sliding_attention", "linear_attention"), so
    `DynamicCache(config=...)` builds KV layers for kept attention and recurrent-state layers for the mixers.
    `mixer` names the linear mixer (a key of `model.mixers.MIXERS`); its options are stored under the key of the
    same name (`gdn` for GDN), so checkpoints written before the key existed load as GDN.
    """

    model_type = "taylor_hybrid"

    base_config: dict | None = None
    layer_types: list[str] | None = None
    attention_heads: dict | None = None
    """Head-wise layers ("hybrid" / "hybrid_sliding" in layer_types): {str(layer): [KV groups kept as attention]};
    the query heads of every other group of that layer are mixer heads."""
    mixer: str = "gdn"
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
    def mixer_options(self) -> dict | None:
        """The mixer's options as stored (a dict; the mixer's spec turns it into its config dataclass)."""
        return getattr(self, self.mixer, None)

    @property
    def gdn_layers(self) -> list[int]:
        """Layers with linear-mixer heads: converted whole or head-wise."""
        return [i for i, t in enumerate(self.layer_types or []) if t == MIXER_TYPE or t in HEADWISE_TYPES.values()]

    def kept_groups(self, layer: int) -> list[int]:
        """KV groups of `layer` kept as softmax attention ([] for a layer converted whole)."""
        return list((self.attention_heads or {}).get(str(layer), []))
