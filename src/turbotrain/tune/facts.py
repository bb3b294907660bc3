"""What the tuner knows about a model before any candidate runs: one plain FP32 forward + backward.

The pass runs on the first row of the user's first batch (a fresh model, in this process) and its
FLOPs and bytes are scaled by the batch's rows: every per-row cost of a batch-parallel model is
linear in the rows, and one row keeps the pass short. From it: the parameter
count; the matmul FLOPs and the bytes every other op moves (turbotrain.profile's OpCounter); the
bytes of the tensors autograd saves for backward (the activations), split into those saved inside
the model's repeated blocks and the rest; the logits' size; which fusion patterns find a site
(fusion/patterns.py on a probe of the same batch) and whether there is a block list to checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..batch import LossContract, as_batch
from ..config import FUSION_PATTERNS
from ..errors import ConfigError
from ..plan import find_head

__all__ = ["ModelFacts", "analyse"]


@dataclass
class ModelFacts:
    params: int
    """Trainable parameters."""
    batch_rows: int
    """Rows of the batch analysed (its first dimension)."""
    matmul_flops: float
    """FLOPs of forward + backward (2 per multiply-add; matmul, conv, attention)."""
    other_bytes: float
    """Bytes read + written by every op without FLOPs (elementwise, norms, softmax, copies), fp32."""
    activation_bytes: int
    """Bytes autograd saved for backward (parameters excluded), fp32, for the whole batch."""
    calls: int = 0
    """ATen calls of forward + backward."""
    block_count: int = 0
    block_saved_bytes: int = 0
    """Of activation_bytes, those saved while a block of the block list ran."""
    block_input_bytes: int = 0
    """The blocks' inputs, summed (what block checkpointing keeps instead)."""
    max_block_saved_bytes: int = 0
    """The most one block saved (what it holds again while it is recomputed)."""
    block_problem: str | None = None
    """Why there is nothing to checkpoint, or None."""
    logits_bytes: int = 0
    """Size of the logits in FP32 (0 when no head produces the model's logits)."""
    sites: dict = field(default_factory=dict)
    """Pattern -> number of fusable sites found."""
    site_problems: dict = field(default_factory=dict)
    """Pattern -> why its sites (if found) cannot be fused, or why none was found."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _first_rows(batch) -> int:
    tensors = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ConfigError("the tuner needs batches whose tensors have a batch dimension (rows first)")
    return int(tensors[0].shape[0])


class _SavedBytes:
    """Counts the bytes autograd saves for backward, once per storage, and which block saved them."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set[int] = set()
        self.total = 0
        self.block: int | None = None
        self.per_block: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        if ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            self.total += _tensor_bytes(t)
            if self.block is not None:
                self.per_block[self.block] = self.per_block.get(self.block, 0) + _tensor_bytes(t)
        return t


def _block_hooks(model: nn.Module, saved: _SavedBytes, facts: ModelFacts, inputs: list) -> list:
    """Hooks that tell ``saved`` which block is running and append each block's input bytes to ``inputs``."""
    from ..memory.checkpoint import find_block_list

    try:
        _, blocks = find_block_list(model)
    except ConfigError as exc:
        facts.block_problem = str(exc)
        return []
    facts.block_count = len(blocks)

    def before(index):
        def hook(module, args):
            saved.block = index
            inputs.extend(_tensor_bytes(a) for a in args[:1] if isinstance(a, torch.Tensor))
        return hook

    def after(module, args, output):
        saved.block = None

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(before(i)))
        handles.append(block.register_forward_hook(after))
    return handles


def _find_sites(build_model, batch, device, has_loss_fn: bool) -> tuple[dict, dict]:
    from ..fusion.loss_head import NO_HEAD, functional_head_of
    from ..fusion.patterns import find_sites
    from ..fusion.probe import probe

    model = build_model().to(device)
    b = as_batch(batch, device, has_loss_fn)
    trace = probe(model, (b.args, b.kwargs))
    structural = [p for p in FUSION_PATTERNS if p != "linear_cross_entropy"]
    sites, problems = {p: 0 for p in FUSION_PATTERNS}, {}
    for site in find_sites(model, structural, trace):
        if site.problem is None:
            sites[site.pattern] += 1
        else:
            problems.setdefault(site.pattern, site.problem)
    trace.release()
    head = find_head(model, lambda: model(*b.args, **b.kwargs))
    if head is None:
        head = functional_head_of(model, b)
    if head is not None:
        sites["linear_cross_entropy"] = 1
    else:
        problems["linear_cross_entropy"] = NO_HEAD
    return sites, problems


def _first_row(batch):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t[:1] if t.dim() else t, batch)


def analyse(build_model, loss_fn, batch, device: str | torch.device = "cpu") -> ModelFacts:
    """Facts of ``build_model()`` trained on ``batch`` with ``loss_fn`` (None: the model's own loss)."""
    from ..fusion.loss_head import functional_head_of, head_calls
    from ..profile.counting import OpCounter

    device = torch.device(device)
    torch.manual_seed(0)
    model = build_model().to(device).float()
    params = [p for p in model.parameters() if p.requires_grad]
    rows = _first_rows(batch)
    batch = _first_row(batch)
    facts = ModelFacts(params=sum(p.numel() for p in params), batch_rows=rows, matmul_flops=0.0,
                       other_bytes=0.0, activation_bytes=0)
    b = as_batch(batch, device, loss_fn is not None)
    contract = LossContract(loss_fn)
    saved = _SavedBytes(params)
    head_path = find_head(model, lambda: model(*b.args, **b.kwargs))
    head = model.get_submodule(head_path) if head_path is not None else functional_head_of(model, b)
    block_inputs: list[int] = []
    handles = _block_hooks(model, saved, facts, block_inputs)
    if head is not None:
        handles.append(head.register_forward_hook(
            lambda m, a, out: setattr(facts, "logits_bytes", out.numel() * 4) if isinstance(out, torch.Tensor) else None))
    try:
        with OpCounter() as counter:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), head_calls(head):
                loss = contract(model, b)
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    facts.activation_bytes = saved.total * rows
    facts.block_input_bytes = sum(block_inputs) * rows
    facts.block_saved_bytes = sum(saved.per_block.values()) * rows
    facts.max_block_saved_bytes = max(saved.per_block.values(), default=0) * rows
    facts.logits_bytes *= rows
    facts.matmul_flops = float(counter.counts.flops) * rows
    facts.calls = counter.counts.calls
    facts.other_bytes = float(sum(c.bytes for c in counter.counts.ops.values() if not c.flops)) * rows
    facts.sites, facts.site_problems = _find_sites(build_model, batch, device, loss_fn is not None)
    return facts
