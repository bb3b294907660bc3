"""Plant a known fault in a model, so the NaN finder can be seen (and checked) naming it.

'inf-weight' sets one weight of the middle Linear to inf, 'log-zero' makes that layer return
log(0), 'fp16-overflow' scales its weights until its outputs pass fp16's 65504.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from .stats import FP16_MAX

__all__ = ["inject_fault", "INJECTIONS"]

INJECTIONS = ("inf-weight", "log-zero", "fp16-overflow")


def _middle_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError("--inject needs a model with at least one nn.Linear; this workload has none")
    return linears[len(linears) // 2]


def _log_zero_hook(module, args, output):
    return output + torch.log(torch.zeros_like(output))


def inject_fault(model: nn.Module, kind: str, sample_inputs=None) -> str:
    """Plant fault ``kind`` (one of INJECTIONS) in the model's middle Linear; return its path."""
    if kind not in INJECTIONS:
        raise ConfigError(f"--inject {kind!r} is not valid; choose one of: {', '.join(INJECTIONS)}")
    path, layer = _middle_linear(model)
    if kind == "inf-weight":
        with torch.no_grad():
            layer.weight.view(-1)[0] = float("inf")
    elif kind == "log-zero":
        layer.register_forward_hook(_log_zero_hook)
    else:
        seen = []
        handle = layer.register_forward_hook(lambda m, a, out: seen.append(float(out.detach().abs().max())))
        with torch.no_grad():
            model(sample_inputs)
        handle.remove()
        # Twice past fp16's range; the weights themselves stay representable when fan-in allows.
        with torch.no_grad():
            layer.weight.mul_(2 * FP16_MAX / max(seen[0], 1e-12))
    return path
