"""Flat-tensor collectives under the names the installed torch prefers.

torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and warns on the old
names; torch 2.4 (our floor) only has the old ones. Both take (output, input, ..., group=...).
"""

import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

#: Gather equal-sized inputs from every rank, concatenated along dim 0 of ``output``.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: Reduce ``input`` over ranks and keep this rank's dim-0 slice in ``output``.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
