"""Finding fusable sites in an arbitrary nn.Module, and how to build each site's fused form.

A Site names a small *unit* of the user's model (a pair in a Sequential, an MLP, an attention
module's projections, the head), a ``build`` that turns such a unit into its fused form (used
first on a copy, to verify, then on the real unit), an ``install`` that puts the result in place,
and ``sample``/``run`` that say how to exercise the unit on inputs made from its shapes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .modules import (FusedLayerNormAct, FusedLinearAct, FusedQKVProjection, FusedSwiGLUMLP,
                      LinearCrossEntropyHead, QKVSlice)
from .ops._activations import activation_of_module

__all__ = ["Site", "find_sites", "QKV_NAMES", "MLP_NAMES", "SWIGLU_NAMES"]

#: Attention projection names: Llama/Mistral/GPT-NeoX style and HF-BERT style.
QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
#: fc -> act -> proj MLPs (the nanoGPT names are c_fc / gelu / c_proj).
MLP_NAMES = (("fc", "act", "proj"), ("c_fc", "gelu", "c_proj"), ("c_fc", "act", "c_proj"))
SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")
_SAMPLE_ROWS = (2, 5)  # batch, sequence of the verification sample: small, and not a power of two


@dataclass
class Site:
    path: str
    pattern: str
    unit: nn.Module
    build: Callable[[nn.Module], tuple[nn.Module, dict]]
    install: Callable[[nn.Module], None]
    sample: Callable[[torch.dtype, torch.device], tuple]
    run: Callable = field(default=lambda unit, *args: unit(*args))
    problem: Optional[str] = None
    """Set when the site was found but cannot be fused; it is then reported, never built."""


def _is_linear(m) -> bool:
    return type(m) is nn.Linear  # exactly: subclasses (quantised, LoRA) may compute something else


def _sample_x(features: int):
    def sample(dtype, device):
        g = torch.Generator().manual_seed(1)
        return (torch.randn(*_SAMPLE_ROWS, features, generator=g).to(device, dtype).requires_grad_(),)
    return sample


def _join(*parts) -> str:
    return ".".join(p for p in parts if p)


def _hooked(*modules) -> Optional[str]:
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            return "a module of the site has hooks registered, which the fused module would bypass"
    return None


def _tied(counts: Counter, *linears) -> Optional[str]:
    for lin in linears:
        for p in lin.parameters():
            if counts[p] > 1:
                return "a weight is shared (tied) with another module; concatenating it would untie it"
    return None


def _setter(owner: nn.Module, name: str):
    return lambda new: setattr(owner, name, new)


def _sequential_sites(path, seq: nn.Sequential, patterns, claimed) -> list[Site]:
    sites = []
    names = list(seq._modules)
    for i in range(len(names) - 1):
        first, second = seq._modules[names[i]], seq._modules[names[i + 1]]
        act = activation_of_module(second)
        if id(first) in claimed or act is None:
            continue
        if _is_linear(first) and "linear_act" in patterns:
            fused_cls, pattern, features = FusedLinearAct, "linear_act", first.in_features
        elif type(first) is nn.LayerNorm and "layernorm_gelu" in patterns and act.startswith("gelu") \
                and len(first.normalized_shape) == 1:
            fused_cls, pattern, features = FusedLayerNormAct, "layernorm_gelu", first.normalized_shape[0]
        else:
            continue
        claimed.update((id(first), id(second)))

        def build(unit, fused_cls=fused_cls, act=act):
            return nn.Sequential(fused_cls(unit[0], act), nn.Identity()), {}

        def install(new, a=names[i], b=names[i + 1]):
            setattr(seq, a, new[0])
            setattr(seq, b, new[1])

        sites.append(Site(_join(path, names[i]), pattern, nn.Sequential(first, second), build, install,
                          _sample_x(features), problem=_hooked(first, second)))
    return sites


def _mlp_site(path, module, owner, name, claimed) -> Optional[Site]:
    for fc_name, act_name, proj_name in MLP_NAMES:
        fc, act_mod = getattr(module, fc_name, None), getattr(module, act_name, None)
        act = activation_of_module(act_mod) if isinstance(act_mod, nn.Module) else None
        if _is_linear(fc) and act is not None and isinstance(getattr(module, proj_name, None), nn.Module) \
                and id(fc) not in claimed:
            claimed.update((id(fc), id(act_mod)))

            def build(unit, fc_name=fc_name, act_name=act_name, act=act):
                setattr(unit, fc_name, FusedLinearAct(getattr(unit, fc_name), act))
                setattr(unit, act_name, nn.Identity())
                return unit, {}

            # build() edits the unit in place, so installing the real one is a no-op.
            return Site(_join(path, fc_name), "linear_act", module, build, lambda new: None,
                        _sample_x(fc.in_features), problem=_hooked(fc, act_mod))
    return None


def _swiglu_site(path, module, owner, name, counts, claimed) -> Optional[Site]:
    linears = [getattr(module, n, None) for n in SWIGLU_NAMES]
    if not all(_is_linear(m) for m in linears) or any(id(m) in claimed for m in linears):
        return None
    claimed.update(id(m) for m in linears)
    gate, up, _ = linears
    extra = set(module._modules) - set(SWIGLU_NAMES) - {"act_fn", "act"}
    problem = (
        "the model itself is the MLP; fuse its parent, or wrap it" if owner is None else
        f"it has other children ({', '.join(sorted(extra))}) the fused MLP would drop" if extra else
        "it has parameters of its own the fused MLP would drop" if list(module._parameters) else
        "gate_proj and up_proj differ in shape or bias" if gate.weight.shape != up.weight.shape
        or (gate.bias is None) != (up.bias is None) else
        _tied(counts, gate, up) or _hooked(*linears)
    )

    def build(unit):
        g, u, d = (getattr(unit, n) for n in SWIGLU_NAMES)
        fused = FusedSwiGLUMLP(g, u, d)
        h = fused.hidden
        pmap = {g.weight: (fused.gate_up_weight, slice(0, h)), u.weight: (fused.gate_up_weight, slice(h, 2 * h))}
        if g.bias is not None:
            pmap.update({g.bias: (fused.gate_up_bias, slice(0, h)), u.bias: (fused.gate_up_bias, slice(h, 2 * h))})
        return fused, pmap

    install = _setter(owner, name) if owner is not None else (lambda new: None)
    return Site(path, "swiglu", module, build, install, _sample_x(gate.in_features), problem=problem)


def _qkv_site(path, module, counts, claimed) -> Optional[Site]:
    for names in QKV_NAMES:
        linears = [getattr(module, n, None) for n in names]
        if not all(_is_linear(m) for m in linears) or any(id(m) in claimed for m in linears):
            continue
        claimed.update(id(m) for m in linears)
        q = linears[0]
        problem = (
            "q/k/v have different in_features, so they cannot be fed by one input"
            if len({m.in_features for m in linears}) > 1 else
            "some of q/k/v have a bias and some do not" if len({m.bias is None for m in linears}) > 1 else
            "q/k/v differ in dtype or device" if len({(m.weight.dtype, m.weight.device) for m in linears}) > 1 else
            "an attribute named 'qkv_fused' already exists" if hasattr(module, "qkv_fused") else
            _tied(counts, *linears) or _hooked(*linears)
        )

        def build(unit, names=names):
            olds = [getattr(unit, n) for n in names]
            shared = FusedQKVProjection(olds)
            unit.add_module("qkv_fused", shared)
            pmap = {}
            for i, (n, old) in enumerate(zip(names, olds)):
                setattr(unit, n, QKVSlice(shared, i))
                pmap[old.weight] = (shared.weight, shared.offsets(i))
                if old.bias is not None:
                    pmap[old.bias] = (shared.bias, shared.offsets(i))
            return unit, pmap

        def run(unit, x, other, names=names):
            # All three on one input (the fused GEMM), then k alone on another input (cross attention).
            outs = [getattr(unit, n)(x) for n in names] + [getattr(unit, names[1])(other)]
            return torch.cat([o.reshape(-1) for o in outs])

        def sample(dtype, device, f=q.in_features):
            return _sample_x(f)(dtype, device) + (torch.randn(*_SAMPLE_ROWS, f).to(device, dtype).requires_grad_(),)

        return Site(path, "qkv", module, build, lambda new: None, sample, run=run, problem=problem)
    return None


def _head_site(path, module, owner, name, claimed) -> Site:
    claimed.add(id(module))
    from ..workloads.base import cross_entropy_loss

    def sample(dtype, device, f=module.in_features, v=module.out_features):
        g = torch.Generator().manual_seed(2)
        targets = torch.randint(0, v, _SAMPLE_ROWS, generator=g)
        targets[0, :2] = -100  # padding is part of what is verified
        return _sample_x(f)(dtype, device) + (targets.to(device),)

    def run(unit, hidden, targets):
        return cross_entropy_loss(unit(hidden), targets)

    problem = "the model itself is the head" if owner is None else _hooked(module)
    return Site(path, "linear_cross_entropy", module, lambda unit: (LinearCrossEntropyHead(unit), {}),
                _setter(owner, name) if owner is not None else (lambda new: None), sample, run=run,
                problem=problem)


def find_sites(model: nn.Module, patterns, head: Optional[str] = None) -> list[Site]:
    """Every fusable site in ``model`` for the named patterns, in module order.

    ``head`` is the dotted path of the head Linear to fuse with the loss; by default the Linear
    named ``lm_head``.
    """
    counts = Counter(p for _, p in model.named_parameters(remove_duplicate=False))
    owners = {id(child): (mod, n) for mod in model.modules() for n, child in mod._modules.items() if child is not None}
    claimed: set[int] = set()
    sites: list[Site] = []
    for path, module in model.named_modules():
        owner, name = owners.get(id(module), (None, ""))
        found = []
        if "qkv" in patterns:
            found.append(_qkv_site(path, module, counts, claimed))
        if "swiglu" in patterns:
            found.append(_swiglu_site(path, module, owner, name, counts, claimed))
        if "linear_act" in patterns:
            found.append(_mlp_site(path, module, owner, name, claimed))
        if isinstance(module, nn.Sequential):
            found.extend(_sequential_sites(path, module, patterns, claimed))
        is_head = path == head if head is not None else path.rsplit(".", 1)[-1] == "lm_head"
        if "linear_cross_entropy" in patterns and is_head and _is_linear(module) and id(module) not in claimed:
            found.append(_head_site(path, module, owner, name, claimed))
        sites.extend(s for s in found if s is not None)
    return sites
