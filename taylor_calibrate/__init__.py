"""Taylor-Calibrate: convert a pretrained Transformer into a Gated DeltaNet hybrid (the method: docs/method.md).

Importing the package registers the hybrid's config and model with transformers' Auto* factories.
"""
from transformers import AutoConfig, AutoModelForCausalLM

from taylor_calibrate.model.hybrid import HybridForCausalLM, convert_teacher
from taylor_calibrate.model.hybrid_config import HybridConfig
from taylor_calibrate.model.mixers.gdn import GDNConfig

__version__ = "0.1.0"

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)

__all__ = ["GDNConfig", "HybridConfig", "HybridForCausalLM", "convert_teacher"]
