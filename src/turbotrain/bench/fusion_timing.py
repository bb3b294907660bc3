"""Quick local timing of each fused op against its reference twin (forward + backward).

Not the benchmark ladder and not a test: a sanity check that a fast path is fast here.
``python -m turbotrain.bench.fusion_timing [--dtype bf16] [--iters 10]`` prints one row per op at
the gpt workload's default shapes (d=512, T=256, B=8, vocab 8192, MLP hidden 4d).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..fusion import ops

__all__ = ["main", "cases"]

B, T, D, VOCAB = 8, 256, 512, 8192
HIDDEN = 4 * D


def _leaf(*shape, dtype, scale=0.05):
    return (torch.randn(*shape) * scale).to(dtype).requires_grad_()


def cases(dtype):
    """name -> (fused fn, reference fn), each taking no arguments and running forward + backward."""
    x = _leaf(B, T, D, dtype=dtype, scale=1.0)
    w1, b1 = _leaf(HIDDEN, D, dtype=dtype), _leaf(HIDDEN, dtype=dtype)
    ln_w, ln_b = _leaf(HIDDEN, dtype=dtype, scale=1.0), _leaf(HIDDEN, dtype=dtype)
    h = _leaf(B, T, HIDDEN, dtype=dtype, scale=1.0)
    wqkv, bqkv = _leaf(3 * D, D, dtype=dtype), _leaf(3 * D, dtype=dtype)
    wq, wk, wv = (wqkv[i * D:(i + 1) * D].detach().requires_grad_() for i in range(3))
    bq, bk, bv = (bqkv[i * D:(i + 1) * D].detach().requires_grad_() for i in range(3))
    w_gu, w_down = _leaf(2 * HIDDEN, D, dtype=dtype), _leaf(D, HIDDEN, dtype=dtype)
    w_g, w_u = (w_gu[i * HIDDEN:(i + 1) * HIDDEN].detach().requires_grad_() for i in range(2))
    res, bias = _leaf(B, T, D, dtype=dtype, scale=1.0), _leaf(D, dtype=dtype)
    w_head = _leaf(VOCAB, D, dtype=dtype)
    targets = torch.randint(0, VOCAB, (B, T))

    leaves = [t for t in locals().values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def bwd(out):
        # autograd.grad, not backward(): no .grad accumulation (an extra add per leaf) in the timing
        out = out.float().sum() if out.dim() else out
        used = [t for t in leaves if t.requires_grad]
        torch.autograd.grad(out, used, allow_unused=True)

    cat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    return {
        "linear+gelu": (lambda: bwd(ops.linear_act(x, w1, b1, "gelu")),
                        lambda: bwd(ops.linear_act_reference(x, w1, b1, "gelu"))),
        "layernorm+gelu": (lambda: bwd(ops.layernorm_act(h, ln_w, ln_b)),
                           lambda: bwd(ops.layernorm_act_reference(h, ln_w, ln_b))),
        "qkv": (lambda: bwd(cat(ops.qkv_projection(x, wqkv, bqkv, (D, D, D)))),
                lambda: bwd(cat(ops.qkv_projection_reference(x, (wq, wk, wv), (bq, bk, bv))))),
        "swiglu mlp": (lambda: bwd(ops.swiglu_mlp(x, w_gu, w_down)),
                       lambda: bwd(ops.swiglu_mlp_reference(x, w_g, w_u, w_down))),
        "bias+dropout+residual": (lambda: bwd(ops.bias_dropout_residual(x, bias, res, 0.1)),
                                  lambda: bwd(ops.bias_dropout_residual_reference(x, bias, res, 0.1))),
        "linear+cross-entropy": (lambda: bwd(ops.linear_cross_entropy(x, w_head, None, targets)),
                                 lambda: bwd(ops.linear_cross_entropy_reference(x, w_head, None, targets))),
    }


def time_pair(fused, reference, iters: int) -> tuple[float, float]:
    """Min ms of each, the two run alternately so a busy neighbour slows both alike."""
    for _ in range(3):  # warm-up, including the one-time kernel compiles
        fused(), reference()
    samples = ([], [])
    for _ in range(iters):
        for fn, out in ((fused, samples[0]), (reference, samples[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    # The minimum: on a machine shared with other jobs the median mostly measures the neighbours.
    return min(samples[0]) * 1e3, min(samples[1]) * 1e3


def peak_live_mb(fn) -> float:
    """Peak MB of tensor storage alive at once while ``fn`` runs, counted at the dispatcher.

    Counts each new storage once, from its creation to its release; CPU has no allocator stats.
    """
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    live, peak, seen = [0], [0], set()

    def release(key, nbytes):
        seen.discard(key)
        live[0] -= nbytes

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t._base is None:
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key and key not in seen:
                        seen.add(key)
                        live[0] += storage.nbytes()
                        peak[0] = max(peak[0], live[0])
                        weakref.finalize(t, release, key, storage.nbytes())
            return out

    with Track():
        fn()
    return peak[0] / 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    dtype_name = {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
    dtype = getattr(torch, dtype_name)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"B={B} T={T} d={D} hidden={HIDDEN} vocab={VOCAB}; min of {args.iters}, fwd+bwd")
    print(f"{'op':24} {'fused ms':>9} {'ref ms':>9} {'speed-up':>9}")
    for name, (fused, reference) in cases(dtype).items():
        tf, tr = time_pair(fused, reference, args.iters)
        print(f"{name:24} {tf:9.2f} {tr:9.2f} {tr / tf:8.2f}x")
    fused, reference = cases(dtype)["linear+cross-entropy"]
    print(f"linear+cross-entropy peak live tensors: fused {peak_live_mb(fused):.0f} MB, "
          f"reference {peak_live_mb(reference):.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
