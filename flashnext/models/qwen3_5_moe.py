"""Qwen3.5 / 3.6 MoE (`qwen3_5_moe`): the Qwen3-Next block with split GatedDeltaNet projections
(in_proj_qkv / z / b / a, chosen by `ModelConfig.gdn_split_projections`); every layer sparse."""
from flashnext.models.qwen3_next import Qwen3NextForCausalLM


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    pass
