"""Where the elementwise epilogues of the fused ops get their kernels.

On CPU the epilogues are plain PyTorch functions run through ``torch.compile`` (Inductor writes one
C++/OpenMP loop for what eager PyTorch runs as several passes over memory). On CUDA, layernorm_act,
swiglu and linear_cross_entropy call the hand-written Triton kernels in ``_triton_kernels`` instead,
imported only there; the other ops' epilogues are compiled on CUDA too (Inductor writes Triton).

Setting ``TURBOTRAIN_FUSION_KERNELS=eager`` runs the same epilogue functions without compiling them
(for debugging, or a machine without a C++ compiler). That choice is explicit: a compile that fails
in the default mode raises FusionError naming this switch; it never falls back silently.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Callable

import torch

from ...errors import FusionError

__all__ = ["epilogue", "kernel_mode", "epilogue_frames", "use_triton"]

_MODES = ("compiled", "eager")
#: Dynamo frames compiled for epilogues so far; compile.recompile_count() subtracts them so it counts
#: only the user's model.
_EPILOGUE_FRAMES = [0]


def kernel_mode() -> str:
    """'compiled' (default) or 'eager', from the TURBOTRAIN_FUSION_KERNELS environment variable."""
    mode = os.environ.get("TURBOTRAIN_FUSION_KERNELS", "compiled")
    if mode not in _MODES:
        raise FusionError(
            f"TURBOTRAIN_FUSION_KERNELS={mode!r} is not valid; set it to one of {', '.join(_MODES)}"
        )
    return mode


def epilogue_frames() -> int:
    """How many graphs the fused-op epilogues have compiled in this process (counted as
    recompile_count counts, so the two can be subtracted)."""
    return _EPILOGUE_FRAMES[0]


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` lives on CUDA, where the Triton kernels replace the compiled epilogues."""
    return t.is_cuda and kernel_mode() == "compiled"


def _variant_key(args, kwargs) -> tuple:
    """What a compiled kernel is specialised on: tensor dtypes/ranks/devices and the plain values."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("T", a.dtype, a.dim(), a.device.type)
        return a
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def epilogue(fn: Callable) -> Callable:
    """Decorate a plain-PyTorch elementwise function so it runs as one compiled kernel.

    ``dynamic=True`` keeps one kernel for every row count and width. Each variant (activation
    name, dtypes, which optional tensors are present) gets its own copy of the function's code
    object: Dynamo's recompile limit counts per code object, and a model legitimately uses more
    variants (4 activations x 2 dtypes x ...) than that limit allows one function.
    """
    variants: dict[tuple, Callable] = {}

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if kernel_mode() == "eager":
            return fn(*args, **kwargs)
        key = _variant_key(args, kwargs)
        compiled = variants.get(key)
        if compiled is None:
            code = fn.__code__.replace(co_name=f"{fn.__name__}_v{len(variants)}")
            clone = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
            compiled = variants[key] = torch.compile(clone, dynamic=True, fullgraph=True)
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:  # surface any compiler failure as one actionable error
            raise FusionError(
                f"torch.compile failed to build the fused epilogue {fn.__name__!r} "
                f"({type(exc).__name__}: {exc}). Fix the compiler setup (a C++ compiler is needed on "
                "CPU), or set TURBOTRAIN_FUSION_KERNELS=eager to run the fused ops uncompiled."
            ) from exc
        finally:
            _EPILOGUE_FRAMES[0] += counters["stats"]["unique_graphs"] - before

    run.reference = fn
    return run
