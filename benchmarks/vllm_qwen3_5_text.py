"""A text-only Qwen3.5 causal LM for vLLM 0.26 (imported by vLLM through benchmarks/serve_vllm.py's plugin; needs vllm).

vLLM 0.26 registers only `Qwen3_5ForConditionalGeneration` (vision tower + language model). An export's config is
text-only (`model_type: qwen3_5_text`, `architectures: [Qwen3_5ForCausalLM]`): unregistered, vLLM renames that
architecture to the multimodal one, which then fails on the missing vision config. vLLM already has the text model,
`qwen3_5.Qwen3_5ForCausalLM` (the multimodal class's `language_model`), but it lacks two things the engine asks of
the class it runs, which the multimodal class supplies:

- the hybrid interface (`IsHybrid`): the shapes, dtypes and copy functions of the GDN layers' conv and recurrent
  states, which the engine sizes its state cache from; taken over unchanged from the multimodal class;
- M-RoPE positions (`SupportsMRoPE`): the export's `rope_parameters` carry `mrope_section`, so the engine feeds every
  layer three position rows; for text the three rows are the token index, which makes M-RoPE plain RoPE.

Weights load by the text class's own loader: the export's names (`model.layers.N.linear_attn.in_proj_qkv`, ...) are
transformers' `Qwen3_5ForCausalLM` names, which `Qwen3_5Model`'s mapper fuses into vLLM's packed projections.
"""
from __future__ import annotations

import torch
from vllm.model_executor.models.interfaces import IsHybrid, SupportsMRoPE
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

ARCHITECTURE = "Qwen3_5ForCausalLM"


def _classmethod_of(cls, name: str) -> classmethod:
    return classmethod(getattr(cls, name).__func__)


class Qwen3_5TextForCausalLM(Qwen3_5ForCausalLM, IsHybrid, SupportsMRoPE):
    """vLLM's Qwen3.5 text model with the hybrid-state and M-RoPE interfaces the engine needs."""

    get_mamba_state_dtype_from_config = _classmethod_of(Qwen3_5ForConditionalGeneration,
                                                        "get_mamba_state_dtype_from_config")
    get_mamba_state_shape_from_config = _classmethod_of(Qwen3_5ForConditionalGeneration,
                                                        "get_mamba_state_shape_from_config")
    get_mamba_state_copy_func = _classmethod_of(Qwen3_5ForConditionalGeneration, "get_mamba_state_copy_func")

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features) -> tuple[torch.Tensor, int]:
        """Text only: the three M-RoPE rows (temporal, height, width) are the token index; generated tokens continue
        from the prompt's length (delta 0)."""
        return torch.arange(len(input_tokens)).expand(3, -1).clone(), 0
