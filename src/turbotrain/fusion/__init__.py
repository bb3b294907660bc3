"""Operator fusion: fused ops with reference twins, modules, a model rewriter, compile helpers.

>>> import torch
>>> from torch import nn
>>> from turbotrain import fusion
>>> model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
>>> report = fusion.fuse(model)
>>> len(report.fused)
1
"""

from .compile import CompileTransform, bucket_length, check_recompile_budget, recompile_count, recompile_limit
from .loss_head import FusedLossHead, install_loss_head
from .modules import FusedLayerNormAct, FusedLinearAct, FusedQKVProjection, FusedSwiGLUMLP, QKVSlice
from .ops import (bias_dropout_residual, bias_dropout_residual_reference, layernorm_act,
                  layernorm_act_reference, linear_act, linear_act_reference, linear_cross_entropy,
                  linear_cross_entropy_reference, qkv_projection, qkv_projection_reference, swiglu,
                  swiglu_mlp, swiglu_mlp_reference, swiglu_reference)
from .optim import fused_adamw
from .rewrite import TOLERANCES, FusedSite, FusionReport, RolledBackSite, fuse, sqnr

__all__ = [
    # rewriting a model
    "fuse", "FusionReport", "FusedSite", "RolledBackSite", "TOLERANCES", "sqnr",
    # fused ops and their reference twins
    "linear_act", "linear_act_reference", "layernorm_act", "layernorm_act_reference",
    "qkv_projection", "qkv_projection_reference", "swiglu", "swiglu_reference", "swiglu_mlp",
    "swiglu_mlp_reference", "bias_dropout_residual", "bias_dropout_residual_reference",
    "linear_cross_entropy", "linear_cross_entropy_reference",
    # modules
    "FusedLinearAct", "FusedLayerNormAct", "FusedQKVProjection", "QKVSlice", "FusedSwiGLUMLP",
    "FusedLossHead", "install_loss_head",
    # optimizer
    "fused_adamw",
    # compile
    "CompileTransform", "bucket_length", "recompile_count", "recompile_limit", "check_recompile_budget",
]
