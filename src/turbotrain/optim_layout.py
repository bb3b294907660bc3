"""The optimizer the Engine steps: bound to the transformed parameters, saved in the stock layout.

Binding: an optimizer *instance* the user passed is kept (``engine.optimizer is optimizer``) and
its parameter groups are re-pointed, before it holds any state, at the Parameters the transforms
left (a fused QKV weight for q/k/v, an FP32 master for a bf16 weight). An optimizer *factory* is
called with those Parameters instead.

Stock layout: the optimizer state is saved keyed by the stock model's parameter names, with each
per-element tensor (Adam's moments) cut to the stock parameter's rows, so a fused run resumes
unfused and back, like the model's own state_dict. Where each name's values live is the plan's
``stock_layout`` (name -> (stepped Parameter, row slice)), which holds no Parameter the model lost.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from .errors import ConfigError
from .plan import ModelPlan

__all__ = ["check_optimizer_params", "bind_optimizer", "stock_state_dict", "load_stock_state_dict"]


def _shapes(params) -> str:
    return ", ".join(str(tuple(p.shape)) for p in list(params)[:4]) + (" ..." if len(params) > 4 else "")


def check_optimizer_params(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]) -> None:
    """Refuse parameters that are not the model's; warn, naming them, about trainable ones left out."""
    own = {p for _, p in named}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = [p for p in held if p not in own]
    if foreign:
        raise ConfigError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not the model's (shapes {_shapes(foreign)}), "
            "so training would not change the model; build it from this model: "
            "torch.optim.AdamW(model.parameters(), ...) or pass a factory: lambda params: AdamW(params, ...)"
        )
    held_set = set(held)
    missing = [n for n, p in named if p.requires_grad and p not in held_set]
    if missing:
        listed = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        warnings.warn(f"{len(missing)} trainable parameter(s) are not in the optimizer and will not be "
                      f"updated: {listed}. Freeze them (requires_grad=False) to silence this.", stacklevel=4)


def bind_optimizer(optimizer, plan: ModelPlan, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer over the transformed parameters (see the module docstring)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        params = [plan.master_of.get(p, p) for p in model.parameters() if p.requires_grad]
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer")
        return built
    remap = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            new, _ = plan.locate(p)
            if new is not p:
                remap[p] = new
    if not remap:
        return optimizer
    if any(len(s) for s in optimizer.state.values()):
        raise ConfigError(
            "the optimizer already holds state (it has stepped), and the transforms replaced parameters it "
            "holds (fusion or FP32 masters); pass a fresh optimizer, or a factory (lambda params: "
            "torch.optim.AdamW(params, lr=...)), and restore state with engine.load_state_dict()"
        )
    placed: dict = {}
    for index, group in enumerate(optimizer.param_groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        params = []
        for p in group["params"]:
            new = remap.get(p, p)
            if new in placed:
                if placed[new] != settings:
                    raise ConfigError("parameters fused into one tensor (q/k/v, gate/up) sit in parameter "
                                      "groups with different settings; put them in one group, or leave "
                                      "that pattern out of Config(fuse=...)")
                continue
            placed[new] = settings
            params.append(new)
        group["params"] = params
    return optimizer


def _stock_entries(layout: dict) -> dict:
    """Stepped Parameter -> [(stock name, row slice or None)], in model order, from a plan's stock_layout."""
    out: dict = {}
    for name, (new, rows) in layout.items():
        out.setdefault(new, []).append((name, rows))
    return out


def stock_state_dict(optimizer: torch.optim.Optimizer, layout: dict) -> dict:
    """The optimizer's state keyed by stock parameter names, per-element tensors cut to their rows.

    ``layout``: the plan's stock_layout (stock name -> (stepped Parameter, row slice or None))."""
    entries = _stock_entries(layout)
    state, groups = {}, []
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            for name, rows in entries.get(p, []):
                names.append(name)
                per_param = optimizer.state.get(p, {})
                state[name] = {k: (v[rows] if rows is not None and _per_element(v, p) else v).detach().clone()
                               if isinstance(v, torch.Tensor) else v for k, v in per_param.items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"layout": "stock", "state": state, "param_groups": groups}


def _per_element(value: torch.Tensor, param: torch.Tensor) -> bool:
    return value.dim() > 0 and value.shape == param.shape


def load_stock_state_dict(optimizer: torch.optim.Optimizer, saved: dict, layout: dict) -> None:
    """Inverse of :func:`stock_state_dict`, onto however this Engine's parameters are fused."""
    entries = _stock_entries(layout)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ConfigError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter group(s), this "
                          f"one {len(optimizer.param_groups)}; build the optimizer with the same groups")
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        wanted = {name for p in group["params"] for name, _ in entries.get(p, [])}
        if wanted != set(saved_group["params"]):
            diff = sorted(wanted ^ set(saved_group["params"]))
            raise ConfigError(f"the checkpoint's optimizer groups hold other parameters than this one's "
                              f"(differing: {', '.join(diff[:5])}); build the optimizer over the same parameters")
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    state = saved["state"]
    for group in optimizer.param_groups:
        for p in group["params"]:
            located = sorted(entries.get(p, []), key=lambda e: e[1].start if e[1] is not None else 0)
            parts = [(state.get(name), rows) for name, rows in located]
            if not parts or any(s is None for s, _ in parts):
                continue  # nothing saved yet for it (the optimizer had not stepped it)
            merged = {}
            for key, value in parts[0][0].items():
                if isinstance(value, torch.Tensor) and parts[0][1] is not None and value.dim() > 0:
                    value = torch.cat([s[key] for s, _ in parts])
                merged[key] = value.to(p.device) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
            optimizer.state[p] = merged
