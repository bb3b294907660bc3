"""The Triton kernels of the CUDA path, run by Triton's CPU interpreter on tiny shapes.

They are compared with the compiled-epilogue functions the CPU path uses (whose own tests compare
them with the PyTorch reference twins). Skipped where Triton is not installed.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton to run these)")


def test_triton_kernels_under_the_interpreter():
    # TRITON_INTERPRET is read when triton is first imported, and torch may already have imported
    # it in this process, so the checks run in a fresh interpreter (this file, as a script).
    env = dict(os.environ, TRITON_INTERPRET="1", TURBOTRAIN_FUSION_KERNELS="eager")
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("ok ") == len(CHECKS), done.stdout


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # fp32 both sides; order of sums differs


def check_layernorm_act(kernels, act, affine, transposed=False):
    from turbotrain.fusion.ops.layernorm_gelu import _backward, _forward

    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(7, 37, generator=g) * 2, torch.randn(7, 37, generator=g)
    if transposed:  # dense but column-major, as x.t() of a row-major tensor is
        x = x.t().contiguous().t()
        assert not x.is_contiguous()
    w, b = (torch.randn(37, generator=g), torch.randn(37, generator=g)) if affine else (None, None)
    got, want = kernels.layernorm_act_forward(x, w, b, 1e-5, act), _forward(x, w, b, 1e-5, act)
    for a, e in zip(got, want):
        close(a, e)
    got = kernels.layernorm_act_backward(grad, x, w, b, want[1], want[2], act)
    for a, e in zip(got, _backward(grad, x, w, b, want[1], want[2], act)):
        close(a, e)


def check_swiglu(kernels):
    from turbotrain.fusion.ops.swiglu import _backward, _forward

    g = torch.Generator().manual_seed(1)
    gate_up, grad = torch.randn(5, 3, 46, generator=g), torch.randn(5, 3, 23, generator=g)
    close(kernels.swiglu_forward(gate_up), _forward(gate_up))
    close(kernels.swiglu_backward(grad, gate_up), _backward(grad, gate_up))


def check_cross_entropy_chunk(kernels, vocab, smoothing=0.0, weighted=False):
    from turbotrain.fusion.ops.linear_cross_entropy import _ce_chunk

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, vocab, generator=g) * 3
    targets = torch.tensor([1, 2, -100, 4, vocab - 1, 0])
    weight = torch.rand(vocab, generator=g) * 2 if weighted else None
    for a, e in zip(kernels.cross_entropy_chunk(logits, targets, -100, True, smoothing, weight),
                    _ce_chunk(logits, targets, -100, True, smoothing, weight)):
        close(a, e)


def check_cross_entropy_bias_grad_in_fp32(kernels):
    # bf16 logits: the bias grad must be the FP32 sum of FP32 softmax gradients (as the eager twin
    # computes it), not a sum of gradients already rounded to bf16 (off by ~1e-3 relative here).
    from turbotrain.fusion.ops.linear_cross_entropy import _ce_chunk

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 300, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 300, (64,), generator=g)
    targets[::7] = -100
    got, want = kernels.cross_entropy_chunk(logits, targets, -100, True), _ce_chunk(logits, targets, -100, True)
    assert got[2].dtype == torch.float32
    close(got[0], want[0])
    close(got[2], want[2])
    torch.testing.assert_close(got[1], want[1])  # the stored grad itself is bf16 on both sides


def check_ops_end_to_end_on_the_kernel_path(kernels, vocab, smoothing=0.0, weighted=False):
    # The ops' CUDA code path (wrappers, chunking, FP32 scaling, bias kernel) with the interpreter
    # standing in for the GPU: use_triton says yes to CPU tensors.
    import importlib

    layernorm_gelu = importlib.import_module("turbotrain.fusion.ops.layernorm_gelu")
    lce = importlib.import_module("turbotrain.fusion.ops.linear_cross_entropy")  # the package's name is the function
    layernorm_gelu.use_triton = lce.use_triton = lambda t: True
    g = torch.Generator().manual_seed(4)
    h, w, b = (torch.randn(*s, generator=g).requires_grad_() for s in ((50, 16), (vocab, 16), (vocab,)))
    targets = torch.randint(0, vocab, (50,), generator=g)
    targets[::9] = -100
    weight = torch.rand(vocab, generator=g) + 0.5 if weighted else None
    got = lce.linear_cross_entropy(h, w, b, targets, chunk_rows=16, label_smoothing=smoothing, class_weight=weight)
    want = lce.linear_cross_entropy_reference(h, w, b, targets, label_smoothing=smoothing, class_weight=weight)
    close(got, want)
    for a, e in zip(torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(want, (h, w, b))):
        close(a, e)
    x = (torch.randn(37, 7, generator=g) * 2).t().requires_grad_()  # column-major rows
    lw, lb = torch.randn(37, generator=g).requires_grad_(), torch.randn(37, generator=g).requires_grad_()
    got = layernorm_gelu.layernorm_act(x, lw, lb)
    want = layernorm_gelu.layernorm_act_reference(x, lw, lb)
    close(got, want)
    for a, e in zip(torch.autograd.grad(got.sum(), (x, lw, lb)), torch.autograd.grad(want.sum(), (x, lw, lb))):
        close(a, e)


CHECKS = [(check_layernorm_act, (a, f)) for a in ("relu", "gelu", "gelu_tanh", "silu") for f in (True, False)]
CHECKS += [(check_layernorm_act, ("gelu", True, True)), (check_swiglu, ()),
           (check_cross_entropy_chunk, (50,)), (check_cross_entropy_chunk, (5000,)),
           (check_cross_entropy_bias_grad_in_fp32, ()), (check_ops_end_to_end_on_the_kernel_path, (1000,)),
           (check_ops_end_to_end_on_the_kernel_path, (5000,))]
# F.cross_entropy's label_smoothing and weight=: each alone and both, over one block and several
CHECKS += [(check_cross_entropy_chunk, (v, s, w)) for v in (50, 5000) for s, w in ((0.1, False), (0.0, True), (0.2, True))]
CHECKS += [(check_ops_end_to_end_on_the_kernel_path, (1000, 0.1, True))]

if __name__ == "__main__":
    from turbotrain.fusion.ops import _triton_kernels

    for fn, args in CHECKS:  # 5000: several blocks of the online softmax; 50: one
        fn(_triton_kernels, *args)
        print("ok", fn.__name__, *args)
