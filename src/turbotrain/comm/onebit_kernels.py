"""1-bit Adam's elementwise steps as torch.compile'd single loops.

On layouts of ``COMPILE_MIN_NUMEL`` elements or more, the elementwise steps that eager torch runs
as 2-4 passes each run as compiled single loops (dynamic sizes, compiled once, on the first
compressed step): momentum plus its add into the worker error, the sign packing, the residual
x - scale * sign(x) straight from x (no unpacking), and the clipped frozen update with the weight
decay. The packing and residuals are bitwise the eager ones; the momentum kernel rounds
b1 m + (1 - b1) g as the paper writes it (twice) where eager ``add_(g, alpha)`` fuses the
multiply-add, so an element whose m + e sits within an ulp of 0 can send the other sign.
Without a working compiler the kernels fall back to the eager steps, with one warning.
"""

import warnings

import torch

#: Layouts of at least this many elements run their residual and parameter update as compiled
#: kernels (one fused loop each instead of 2-4 eager passes; sizes are dynamic, so each kernel is
#: compiled once); below it a compile costs more than it saves.
COMPILE_MIN_NUMEL = 1 << 20
_COMPILED: dict = {}
_COMPILE_FAILED: list = []


def _sub_sign(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x <- x - scale * sign(x), sign +1 at 0 as packed: the residual, from x alone (no unpacking)."""
    x.copy_(torch.where(x >= 0, x - scale, x + scale))


def _pack_rows(x: torch.Tensor, out: torch.Tensor) -> None:
    """``pack_signs`` as one loop: byte i of a row holds the signs of its elements 8i .. 8i + 7."""
    bits = (x >= 0).view(x.shape[0], -1, 8).to(torch.int32)
    packed = bits[..., 0]
    for i in range(1, 8):
        packed = packed | (bits[..., i] << i)
    out.copy_(packed.to(torch.uint8))


def _momentum_into_error(m, g, e, beta1, rest) -> None:
    """m <- beta1 m + rest g (the paper's two roundings) and e <- e + m, in one loop."""
    new = m * beta1 + g * rest
    m.copy_(new)
    e.copy_(e + new)


def _clipped_update(p, m, denom, decay, alpha, bound) -> None:
    """p <- p * decay + alpha * clamp(m / denom, -bound, bound): weight decay and the clipped step."""
    p.copy_(p * decay + torch.clamp(m / denom, -bound, bound) * alpha)


def _scalars(like: torch.Tensor, *values: float) -> list:
    """0-d tensors for a compiled kernel: Python floats would be baked in and recompile each step."""
    return [torch.tensor(v, dtype=like.dtype, device=like.device) for v in values]


def compile_failed() -> bool:
    """True once a kernel's compile has failed in this process (they all run eagerly from then on)."""
    return bool(_COMPILE_FAILED)


def _run_compiled(fn, *args) -> bool:
    """``fn`` compiled (once, dynamic sizes); False, after one warning, where torch.compile cannot run."""
    if _COMPILE_FAILED:
        return False
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    try:
        _COMPILED[fn](*args)
    except Exception as exc:  # e.g. no C++ compiler for Inductor: said once, eager from here on
        _COMPILE_FAILED.append(exc)
        warnings.warn(f"1-bit Adam: torch.compile of its kernels failed ({type(exc).__name__}: {exc}); they run "
                      "eagerly (2-4 passes over memory each instead of one). Inductor on CPU needs a C++ "
                      "compiler (e.g. apt-get install g++).", RuntimeWarning, stacklevel=3)
        return False
    return True
