"""The fused ops' CUDA paths (Triton kernels) against the CPU fp32 references; scripts/gpu-check.sh.

Shapes are odd on purpose (123 rows and features: partial Triton blocks), vocabularies are not
powers of two (1000) or span several blocks of the online softmax (5000 > 4096), and some inputs
are transposed views: each is a way the kernels' masks or strides can go wrong that a tidy
power-of-two contiguous shape hides.
"""

import pytest
import torch
from test_fusion_ops import DTYPES, check_fp16_loss_scale, compare, leaves

from turbotrain.errors import FusionError
from turbotrain.fusion import (layernorm_act, layernorm_act_reference, linear_act, linear_act_reference,
                               linear_cross_entropy, linear_cross_entropy_reference, swiglu_mlp,
                               swiglu_mlp_reference)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check.sh)"),
]
SHAPE = (5, 123, 123)  # odd rows and an odd width: both dimensions end in a partial block
CUDA_DTYPES = DTYPES + [
    # fp16: 3 more mantissa bits than bf16 (18 dB less rounding noise), so a bar 10 dB above bf16's.
    pytest.param(torch.float16, {"sqnr": 40.0}, id="fp16"),
]


def on_cuda(tensors):
    return [t.detach().cuda().requires_grad_() for t in tensors]


def transposed_on_cuda(t):
    """A CUDA leaf with ``t``'s values laid out column-major (dense, but not row-major)."""
    return t.detach().t().contiguous().cuda().t().requires_grad_()


@pytest.mark.parametrize("dtype,tol", CUDA_DTYPES)
def test_layernorm_gelu_cuda(dtype, tol):
    b, t, d = SHAPE
    x, w, bias = leaves(dtype, (b, t, d), (d,), (d,))
    compare(lambda x, w, bias: layernorm_act(x, w, bias, 1e-5, "gelu"),
            lambda x, w, bias: layernorm_act_reference(x, w, bias, 1e-5, "gelu"), on_cuda([x * 3 + 1, w, bias]), tol)


@pytest.mark.parametrize("dtype,tol", CUDA_DTYPES)
def test_layernorm_gelu_cuda_transposed_input(dtype, tol):
    # dx used to be allocated with x's (column-major) strides and written row-major.
    x, w, bias = leaves(dtype, (615, 123), (123,), (123,))
    xt = transposed_on_cuda(x * 3 + 1)
    assert not xt.is_contiguous()
    compare(lambda x, w, bias: layernorm_act(x, w, bias, 1e-5, "gelu"),
            lambda x, w, bias: layernorm_act_reference(x, w, bias, 1e-5, "gelu"), [xt, *on_cuda([w, bias])], tol)


@pytest.mark.parametrize("dtype,tol", CUDA_DTYPES)
def test_layernorm_wide_rows_cuda(dtype, tol):
    # 8192 features: the block where the kernels switch to 16 warps
    x, w, bias = leaves(dtype, (7, 8191), (8191,), (8191,))
    compare(lambda x, w, bias: layernorm_act(x, w, bias, 1e-5, "gelu"),
            lambda x, w, bias: layernorm_act_reference(x, w, bias, 1e-5, "gelu"), on_cuda([x, w, bias]), tol)


@pytest.mark.parametrize("dtype,tol", CUDA_DTYPES)
def test_linear_gelu_cuda(dtype, tol):
    b, t, d = SHAPE
    inputs = on_cuda(leaves(dtype, (b, t, d), (d + 8, d), (d + 8,), scale=0.5))
    compare(lambda x, w, bias: linear_act(x, w, bias, "gelu"),
            lambda x, w, bias: linear_act_reference(x, w, bias, "gelu"), inputs, tol)


@pytest.mark.parametrize("dtype,tol", CUDA_DTYPES)
def test_swiglu_cuda(dtype, tol):
    b, t, d = SHAPE
    x, wg, wu, wd = leaves(dtype, (b, t, d), (2 * d + 3, d), (2 * d + 3, d), (d, 2 * d + 3), scale=0.2)
    compare(lambda x, wg, wu, wd: swiglu_mlp(x, torch.cat([wg, wu]), wd), swiglu_mlp_reference,
            on_cuda([x, wg, wu, wd]), tol)


@pytest.mark.parametrize("dtype,tol", CUDA_DTYPES)
@pytest.mark.parametrize("vocab", [1000, 5000])  # one partial block; two blocks of the online softmax
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 37])
def test_linear_cross_entropy_cuda(dtype, tol, vocab, with_bias, chunk_rows):
    h, w, b = leaves(dtype, (5, 123, 64), (vocab, 64), (vocab,), scale=0.5)
    targets = torch.randint(0, vocab, (5, 123), generator=torch.Generator().manual_seed(2))
    targets[0, :50] = -100
    inputs = on_cuda([h, w] + ([b] if with_bias else []))
    fused = lambda h, w, *b: linear_cross_entropy(h, w, b[0] if b else None, targets.cuda(), chunk_rows=chunk_rows)  # noqa: E731
    ref = lambda h, w, *b: linear_cross_entropy_reference(h, w, b[0] if b else None, targets)  # noqa: E731
    compare(fused, ref, inputs, tol)


@pytest.mark.parametrize("dtype,tol", CUDA_DTYPES)
@pytest.mark.parametrize("smoothing, weighted", [(0.1, False), (0.0, True), (0.2, True)])
def test_linear_cross_entropy_cuda_label_smoothing_and_class_weights(dtype, tol, smoothing, weighted):
    h, w, b = leaves(dtype, (5, 123, 64), (5000, 64), (5000,), scale=0.5)
    g = torch.Generator().manual_seed(2)
    targets = torch.randint(0, 5000, (5, 123), generator=g)
    targets[0, :50] = -100
    weight = torch.rand(5000, generator=g) + 0.5 if weighted else None
    settings = dict(label_smoothing=smoothing)
    fused = lambda h, w, b: linear_cross_entropy(h, w, b, targets.cuda(), chunk_rows=200, **settings,  # noqa: E731
                                                 class_weight=None if weight is None else weight.cuda())
    ref = lambda h, w, b: linear_cross_entropy_reference(h, w, b, targets, **settings, class_weight=weight)  # noqa: E731
    compare(fused, ref, on_cuda([h, w, b]), tol)


def test_linear_cross_entropy_cuda_transposed_hidden():
    h, w = leaves(torch.bfloat16, (123, 64), (1000, 64), scale=0.5)
    targets = torch.randint(0, 1000, (123,), generator=torch.Generator().manual_seed(2))
    compare(lambda h, w: linear_cross_entropy(h, w, None, targets.cuda()),
            lambda h, w: linear_cross_entropy_reference(h, w, None, targets),
            [transposed_on_cuda(h), *on_cuda([w])], {"sqnr": 30.0})


@pytest.mark.parametrize("chunk_rows", [None, 128])
def test_linear_cross_entropy_fp16_survives_a_2_16_loss_scale_cuda(chunk_rows):
    check_fp16_loss_scale("cuda", chunk_rows=chunk_rows)


def test_linear_cross_entropy_cuda_names_an_out_of_range_target():
    targets = torch.tensor([1, -100, 1000, 3], device="cuda")
    with pytest.raises(FusionError, match="target 1000 is outside the vocabulary"):
        linear_cross_entropy(torch.randn(4, 8, device="cuda"), torch.randn(1000, 8, device="cuda"), None, targets)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: tensors on one, the current device the other")
def test_kernels_launch_on_the_tensors_gpu_not_the_current_one():
    x, w, bias = leaves(torch.bfloat16, (64, 123), (123,), (123,))
    ref = layernorm_act_reference(x.float(), w.float(), bias.float())
    with torch.cuda.device(0):
        on_1 = [t.detach().to("cuda:1").requires_grad_() for t in (x, w, bias)]
        out = layernorm_act(*on_1)
        out.float().sum().backward()
    assert out.device == torch.device("cuda:1")
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)  # bf16 output rounding
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in on_1)
