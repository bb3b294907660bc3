"""Sparse exchange of ``nn.Embedding(sparse=True)`` gradients: send only the rows that were touched.

A dense all-reduce of a 50k x 768 embedding gradient moves every row although a batch touches a
few thousand. Here each rank all_gathers its (row index, row values) pairs instead, padded to the
largest count (collectives need equal sizes), and sums the union. DDP is told to ignore these
parameters, so their exchange happens here, once per synchronising backward, from a
post-accumulate-grad hook. With ``strategy='parameter_server'`` or ``'hybrid'`` the pairs go
through the parameter servers instead (strategies.ps_sparse_mean).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_flat

__all__ = ["sparse_embedding_params", "allgather_sparse_mean", "SparseExchange"]


def sparse_embedding_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Fully qualified name -> weight of every nn.Embedding / EmbeddingBag with sparse=True."""
    out = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse and mod.weight.requires_grad:
            out[f"{mod_name}.weight" if mod_name else "weight"] = mod.weight
    return out


def allgather_sparse_mean(grad: torch.Tensor, group=None, counter=None) -> torch.Tensor:
    """Mean over ranks of a sparse COO gradient, as a coalesced sparse tensor of the same shape."""
    world = dist.get_world_size(group)
    grad = grad.coalesce()
    indices, values = grad.indices(), grad.values()
    nnz = torch.tensor([indices.shape[1]], dtype=torch.int64, device=values.device)
    counts = torch.empty(world, dtype=torch.int64, device=values.device)
    all_gather_flat(counts, nnz, group=group)
    counts_list = counts.tolist()
    width = max(counts_list)
    pad_idx = indices.new_zeros(indices.shape[0], width)
    pad_idx[:, : indices.shape[1]] = indices
    pad_val = values.new_zeros((width,) + values.shape[1:])
    pad_val[: values.shape[0]] = values
    # Gathered along dim 0 (what gloo and NCCL both accept), then split per rank.
    all_idx = indices.new_empty((world * pad_idx.shape[0],) + pad_idx.shape[1:])
    all_val = values.new_empty((world * width,) + pad_val.shape[1:])
    all_gather_flat(all_idx, pad_idx.contiguous(), group=group)
    all_gather_flat(all_val, pad_val.contiguous(), group=group)
    all_idx = all_idx.view((world,) + pad_idx.shape)
    all_val = all_val.view((world,) + pad_val.shape)
    if counter is not None:  # this rank's parts: its count, its padded indices and rows
        counter.count(nnz.numel() * 8 + pad_idx.numel() * pad_idx.element_size()
                      + pad_val.numel() * pad_val.element_size(), calls=3)
    idx = torch.cat([all_idx[r, :, :c] for r, c in enumerate(counts_list)], dim=1)
    val = torch.cat([all_val[r, :c] for r, c in enumerate(counts_list)], dim=0)
    return torch.sparse_coo_tensor(idx, val / world, grad.shape).coalesce()


class SparseExchange:
    """Hooks that replace each sparse embedding gradient by its cross-rank mean after backward."""

    def __init__(self, params: dict[str, nn.Parameter], group=None, counter=None,
                 mean: Callable = allgather_sparse_mean):
        self.params = params
        self.group = group
        self.counter = counter
        self.mean = mean
        """``mean(grad, group, counter)`` -> the sparse mean over ranks (all_gather or parameter servers)."""
        self.enabled = True
        """False inside ``CommState.no_sync()``: accumulate locally, exchange on the closing micro-step."""
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params.values()]

    def _hook(self, param: torch.Tensor) -> None:
        if not self.enabled or param.grad is None:
            return
        grad = param.grad
        if not grad.is_sparse:
            grad = grad.to_sparse()
        param.grad = self.mean(grad, self.group, self.counter)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
