"""The global gradient norm, and clipping by it, over parameters sharded on different meshes.

Under tensor parallel the split weights are DTensors on the (dp_shard, tp) mesh while the
weights no plan splits (position embeddings, norms without sequence parallel) live on dp_shard
alone, and torch's ``clip_grad_norm_`` stacks every parameter's norm into one tensor (and scales
them in one foreach op), which DTensor refuses across meshes. Here the norm is taken per mesh
(torch's own ``get_total_norm`` on each group, made a plain number with ``full_tensor``) and the
per-mesh norms are combined, which for a p-norm is the p-norm of the parts; the scaling is done per
mesh. On one mesh (FSDP alone) it is torch's computation.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(3)); w.grad = torch.full((3,), 2.0)
>>> round(float(clip_grad_norm_([w], max_norm=1.0)), 4), [round(float(g), 4) for g in w.grad]
(3.4641, [0.5774, 0.5774, 0.5774])
"""

from __future__ import annotations

import torch

__all__ = ["grad_norm", "clip_grad_norm_"]


def _mesh(t: torch.Tensor):
    from torch.distributed.tensor import DTensor

    return t.device_mesh if isinstance(t, DTensor) else None


def grad_norm(grads, norm_type: float = 2.0, foreach: bool | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of all ``grads`` together, a plain 0-d tensor (collective over their meshes).

    The sharded twin of ``torch.nn.utils.get_total_norm``.
    """
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for g in grads:
        if g is not None:
            groups.setdefault(_mesh(g), []).append(g)
    if not groups:
        return torch.zeros(())
    parts = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, foreach=foreach)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.nn.utils.get_total_norm(parts, norm_type)


def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0, foreach: bool | None = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so their global norm is at most ``max_norm``; return the norm before.

    The sharded twin of ``torch.nn.utils.clip_grad_norm_``.
    """
    params = [p for p in params if p.grad is not None]
    total = grad_norm([p.grad for p in params], norm_type, foreach)
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(_mesh(p.grad), []).append(p)
    for group in by_mesh.values():  # one foreach op may not mix meshes either
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total
