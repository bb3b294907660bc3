"""Fused ops, each next to its plain-PyTorch reference twin (``<name>_reference``)."""

from .bias_dropout_residual import bias_dropout_residual, bias_dropout_residual_reference
from .layernorm_gelu import layernorm_act, layernorm_act_reference
from .linear_act import linear_act, linear_act_reference
from .linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from .qkv import qkv_projection, qkv_projection_reference
from .swiglu import swiglu, swiglu_mlp, swiglu_mlp_reference, swiglu_reference

__all__ = [
    "linear_act", "linear_act_reference",
    "layernorm_act", "layernorm_act_reference",
    "qkv_projection", "qkv_projection_reference",
    "swiglu", "swiglu_reference", "swiglu_mlp", "swiglu_mlp_reference",
    "bias_dropout_residual", "bias_dropout_residual_reference",
    "linear_cross_entropy", "linear_cross_entropy_reference",
]
