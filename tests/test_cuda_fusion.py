"""The fused ops' CUDA paths (Triton kernels) against the CPU fp32 references; scripts/gpu-check.sh."""

import pytest
import torch
from test_fusion_ops import DTYPES, compare, leaves

from turbotrain.fusion import (layernorm_act, layernorm_act_reference, linear_act, linear_act_reference,
                               linear_cross_entropy, linear_cross_entropy_reference, swiglu_mlp,
                               swiglu_mlp_reference)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check.sh)"),
]
SHAPE = (5, 123, 128)  # odd rows on purpose


def on_cuda(tensors):
    return [t.detach().cuda().requires_grad_() for t in tensors]


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_layernorm_gelu_cuda(dtype, tol):
    b, t, d = SHAPE
    x, w, bias = leaves(dtype, (b, t, d), (d,), (d,))
    compare(lambda x, w, bias: layernorm_act(x, w, bias, 1e-5, "gelu"),
            lambda x, w, bias: layernorm_act_reference(x, w, bias, 1e-5, "gelu"), on_cuda([x * 3 + 1, w, bias]), tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_linear_gelu_cuda(dtype, tol):
    b, t, d = SHAPE
    inputs = on_cuda(leaves(dtype, (b, t, d), (d + 8, d), (d + 8,), scale=0.5))
    compare(lambda x, w, bias: linear_act(x, w, bias, "gelu"),
            lambda x, w, bias: linear_act_reference(x, w, bias, "gelu"), inputs, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_swiglu_cuda(dtype, tol):
    b, t, d = SHAPE
    x, wg, wu, wd = leaves(dtype, (b, t, d), (2 * d, d), (2 * d, d), (d, 2 * d), scale=0.2)
    compare(lambda x, wg, wu, wd: swiglu_mlp(x, torch.cat([wg, wu]), wd), swiglu_mlp_reference,
            on_cuda([x, wg, wu, wd]), tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_linear_cross_entropy_cuda(dtype, tol):
    h, w = leaves(dtype, (5, 123, 64), (512, 64), scale=0.5)
    targets = torch.randint(0, 512, (5, 123), generator=torch.Generator().manual_seed(2))
    targets[0, :50] = -100
    compare(lambda h, w: linear_cross_entropy(h, w, None, targets.cuda()),
            lambda h, w: linear_cross_entropy_reference(h, w, None, targets), on_cuda([h, w]), tol)
