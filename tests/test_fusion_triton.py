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
    assert done.stdout.count("ok ") == 11, done.stdout


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # fp32 both sides; order of sums differs


def check_layernorm_act(kernels, act, affine):
    from turbotrain.fusion.ops.layernorm_gelu import _backward, _forward

    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(7, 37, generator=g) * 2, torch.randn(7, 37, generator=g)
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


def check_cross_entropy_chunk(kernels, vocab):
    from turbotrain.fusion.ops.linear_cross_entropy import _ce_chunk

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, vocab, generator=g) * 3
    targets = torch.tensor([1, 2, -100, 4, vocab - 1, 0])
    scale = torch.tensor(1 / 5)
    for a, e in zip(kernels.cross_entropy_chunk(logits, targets, -100, scale, True),
                    _ce_chunk(logits, targets, -100, scale, True)):
        close(a, e)


if __name__ == "__main__":
    from turbotrain.fusion.ops import _triton_kernels

    checks = [(check_layernorm_act, (a, f)) for a in ("relu", "gelu", "gelu_tanh", "silu") for f in (True, False)]
    checks += [(check_swiglu, ()), (check_cross_entropy_chunk, (50,)), (check_cross_entropy_chunk, (5000,))]
    for fn, args in checks:  # 5000: several blocks of the online softmax; 50: one
        fn(_triton_kernels, *args)
        print("ok", fn.__name__, *args)
