"""Gated DeltaNet, the toolkit's linear mixer (docs/method.md, "The GDN layer"): its options, layer, phase 1 and
export map, gathered in GDN_SPEC."""
from taylor_calibrate.model.mixers.gdn.calibrate import CALIBRATORS
from taylor_calibrate.model.mixers.gdn.config import GDNConfig
from taylor_calibrate.model.mixers.gdn.export import QWEN3_5
from taylor_calibrate.model.mixers.gdn.module import (GatedDeltaNet, build, copy_attention_weights,
                                                      init_recurrent_defaults, state_bytes)
from taylor_calibrate.model.mixers.spec import MixerSpec
from taylor_calibrate.ops import GDN_KERNELS

PARAM_GROUPS = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
    "a_proj": "dynamics", "b_proj": "dynamics", "A_log": "dynamics", "dt_bias": "dynamics", "g_proj": "new",
    "q_conv1d": "new", "k_conv1d": "new", "v_conv1d": "new",
    "o_norm": "o_norm", "o_proj": "o_proj",
}

GDN_SPEC = MixerSpec(
    name="gdn", config=GDNConfig, module=GatedDeltaNet, build=build, copy_from_attention=copy_attention_weights,
    init_weights=init_recurrent_defaults, calibrators=CALIBRATORS, param_groups=PARAM_GROUPS,
    state_bytes=state_bytes, kernels=GDN_KERNELS, exports={"qwen3_5": QWEN3_5},
)

__all__ = ["GDN_SPEC", "GDNConfig", "GatedDeltaNet"]
