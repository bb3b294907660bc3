"""Tensor-parallel plans: which Linear is split by columns, which by rows, where activations change layout.

Every supported model is a pre-norm transformer, so one Megatron-style plan serves them all; what
differs is where the pieces sit, and a :class:`TPLayout` names them. Per block:

    attention / mlp input     PrepareModuleInput: the (sequence-sharded) residual gathered to replicated
    q, k, v  |  fc / gate, up ColwiseParallel: each rank computes n_head/tp heads (or hidden/tp units)
    out  |  proj / down       RowwiseParallel: partial sums reduced (all-reduce, or reduce-scatter to
                              sequence shards with sequence_parallel)
    norms                     SequenceParallel with sequence_parallel=True (else left replicated)

At the model's ends: the token embedding is vocabulary-parallel (RowwiseParallel on nn.Embedding,
each rank looks up its slice of the vocabulary and the partial rows are all-reduced) and the head is
column-parallel over the vocabulary. With ``ParallelConfig(loss_parallel=True)`` (the default) its
logits stay a DTensor sharded over the vocabulary (``Shard(-1)``), and ``F.cross_entropy`` on them
runs under torch's ``loss_parallel()`` (the ParallelTransform enters it around forward, loss and
backward): each rank holds B x T x V/tp logits, and three all-reduces of B x T values (the softmax's
max and sum, the target's logit) replace the all-gather of (B, T, V). With ``loss_parallel=False``
the logits are gathered back to a plain, replicated tensor, for a loss that does other math on them.

With sequence_parallel the residual stream between blocks is each rank's T/tp slice of the
sequence. It is split at the first block (the embeddings stay whole, because RoPE tables and
causal masks are built from the embedding's sequence length) and gathered again by the head.

A new model family is one :func:`register_layout` call; :func:`find_layout` names what is
supported when a model has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["TPLayout", "LAYOUTS", "register_layout", "find_layout", "check_model", "block_plan", "root_plan",
           "hand_over_own_tensors", "embedding_outside_compile"]


@dataclass(frozen=True)
class TPLayout:
    """Where one model family keeps the modules tensor parallel splits (qualified names)."""

    family: str
    """Name shown in messages ('turbotrain gpt', 'Hugging Face Llama')."""
    matches: Callable[[nn.Module], bool]
    """True for a model of this family."""
    blocks: str
    """The block list (an nn.ModuleList)."""
    attention: str
    """The attention module inside a block."""
    attention_in: tuple[str, ...]
    """Projections into the heads (split by columns), inside ``attention``."""
    attention_out: str
    """Projection out of the heads (split by rows), inside ``attention``."""
    mlp: str
    mlp_in: tuple[str, ...]
    """The MLP's first Linear(s) (split by columns), inside ``mlp``."""
    mlp_out: str
    block_norms: tuple[str, ...]
    """Norms inside a block (sequence-parallel with sequence_parallel=True)."""
    embedding: str
    """The token embedding (vocabulary-parallel)."""
    final_norm: str
    head: str
    """The Linear producing the logits (column-parallel over the vocabulary)."""
    head_counts: Callable[[nn.Module], dict[str, int]]
    """Model -> {what: count} of every size tp must divide (heads, key/value heads)."""
    local_heads: Callable[[nn.Module, int], None] | None = None
    """Tells a block's attention it now holds 1/tp of the heads, for models that reshape with a fixed
    head count (turbotrain's gpt and llama); None where the model infers it from the width (HF Llama's
    ``view(*shape, -1, head_dim)``)."""
    attention_kwarg: str | None = None
    """The keyword the block passes the attention its input by (HF: hidden_states=), else positional."""
    compiles: bool = True
    """False where torch.compile over this plan was measured to train wrong, so the Engine refuses
    ``compile=True`` with tensor parallel on it rather than train a wrong model."""
    compiles_loss_parallel: bool = True
    """False where torch.compile over this plan fails with ``ParallelConfig(loss_parallel=True)``, so
    the Engine refuses that combination (compile with ``loss_parallel=False`` stays allowed)."""


_LAYOUTS: list[TPLayout] = []
LAYOUTS = _LAYOUTS
"""Every registered layout, in the order they are tried."""


def register_layout(layout: TPLayout) -> TPLayout:
    """Add a model family (tried before the built-in ones, so a user's layout wins)."""
    _LAYOUTS.insert(0, layout)
    return layout


def find_layout(model: nn.Module) -> TPLayout:
    """The layout of ``model``'s family; ConfigError naming the supported families when there is none."""
    for layout in _LAYOUTS:
        if layout.matches(model):
            return layout
    supported = ", ".join(layout.family for layout in reversed(_LAYOUTS))
    raise ConfigError(
        f"tensor parallel (tp > 1) has no plan for {type(model).__name__}; supported: {supported}. Use tp=1 "
        "(FSDP alone shards any model), or describe the model with turbotrain.parallel.register_layout(TPLayout(...))"
    )


def check_model(model: nn.Module, layout: TPLayout, tp: int) -> None:
    """Everything the plan needs of ``model``, checked before any rank talks to another (ConfigError)."""
    for what, count in layout.head_counts(model).items():
        if count % tp:
            raise ConfigError(f"tp={tp} must divide the model's {what} ({count}); choose tp among "
                              f"{[d for d in range(1, count + 1) if count % d == 0]}")
    blocks = _expect(model, layout.blocks, nn.ModuleList, layout)
    for block in blocks:
        for path in (*[f"{layout.attention}.{n}" for n in layout.attention_in], f"{layout.attention}.{layout.attention_out}",
                     *[f"{layout.mlp}.{n}" for n in layout.mlp_in], f"{layout.mlp}.{layout.mlp_out}"):
            _expect(block, path, nn.Linear, layout)
    embedding = _expect(model, layout.embedding, nn.Embedding, layout)
    head = _expect(model, layout.head, nn.Linear, layout)
    if head.weight is embedding.weight:
        raise ConfigError(f"tensor parallel does not split a head tied to the embedding ({layout.head} shares "
                          f"{layout.embedding}'s weight); untie them (tie_word_embeddings=False) or use tp=1")


def _expect(root: nn.Module, path: str, kind: type, layout: TPLayout) -> nn.Module:
    try:
        module = root.get_submodule(path)
    except AttributeError:
        module = None
    if not isinstance(module, kind):
        found = "nothing" if module is None else type(module).__name__
        raise ConfigError(
            f"tensor parallel expected a {kind.__name__} at {path} ({layout.family} plan) and found {found}. Fused "
            "modules (Config(fuse=('qkv', 'swiglu', 'linear_act', 'linear_cross_entropy'))) are not split yet: "
            "with tp > 1 leave those patterns out, or use tp=1"
        )
    return module


def _styles():
    # Imported here: torch.distributed.tensor is only loaded when tensor parallel is asked for.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    return Replicate, Shard, ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput


def _gather_input(layout_of_input, desired, kwarg: str | None):
    _, _, _, _, _, PrepareModuleInput = _styles()
    if kwarg is None:
        return PrepareModuleInput(input_layouts=(layout_of_input,), desired_input_layouts=(desired,))
    return PrepareModuleInput(input_kwarg_layouts={kwarg: layout_of_input},
                              desired_input_kwarg_layouts={kwarg: desired})


def block_plan(layout: TPLayout, sequence_parallel: bool, first: bool) -> dict:
    """The parallelize_module plan of one block, keyed by names relative to the block."""
    Replicate, Shard, Colwise, Rowwise, SequenceParallel, PrepareModuleInput = _styles()
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if sequence_parallel and first:
        # The embeddings hand over the whole sequence; from here on each rank keeps its T/tp slice.
        plan[""] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                      use_local_output=True)
    # Wrapping the input as a DTensor once lets q, k and v's input gradients add up as partial sums,
    # reduced in one collective instead of one per projection.
    plan[layout.attention] = _gather_input(residual, Replicate(), layout.attention_kwarg)
    plan[layout.mlp] = _gather_input(residual, Replicate(), None)
    for name in layout.attention_in:
        plan[f"{layout.attention}.{name}"] = Colwise()
    plan[f"{layout.attention}.{layout.attention_out}"] = Rowwise(output_layouts=residual)
    for name in layout.mlp_in:
        plan[f"{layout.mlp}.{name}"] = Colwise()
    plan[f"{layout.mlp}.{layout.mlp_out}"] = Rowwise(output_layouts=residual)
    if sequence_parallel:
        for name in layout.block_norms:
            plan[name] = SequenceParallel()
    return plan


def root_plan(layout: TPLayout, sequence_parallel: bool, loss_parallel: bool = False) -> dict:
    """The plan of the embedding, final norm and head, keyed by names relative to the model.

    ``loss_parallel``: the head hands out its logits as a DTensor sharded over the vocabulary, for
    torch's ``loss_parallel()``; otherwise gathered to a plain, replicated tensor.
    """
    Replicate, Shard, Colwise, Rowwise, SequenceParallel, _ = _styles()
    plan = {layout.embedding: Rowwise(input_layouts=Replicate(), output_layouts=Replicate())}
    head_input = Shard(1) if sequence_parallel else Replicate()
    if sequence_parallel:
        plan[layout.final_norm] = SequenceParallel(use_local_output=True)
    if loss_parallel:
        plan[layout.head] = Colwise(input_layouts=head_input, output_layouts=Shard(-1), use_local_output=False)
    else:
        plan[layout.head] = Colwise(input_layouts=head_input, output_layouts=Replicate())
    return plan


class _OwnTensor(torch.autograd.Function):
    """``x``'s values as a plain tensor that is not a view (same storage and version counter, no copy).

    An ``AsyncCollectiveTensor`` (what ``DTensor.to_local()`` hands out after an async redistribute)
    is waited for: it is a tensor subclass, and passed on as one it reaches torch.compile's graph.
    """

    @staticmethod
    def forward(ctx, x):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        return (x.wait() if isinstance(x, AsyncCollectiveTensor) else x).detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _own_tensor_output(module, args, output):
    return _OwnTensor.apply(output) if isinstance(output, torch.Tensor) and output._base is not None else output


def _plain_output(module, args, output):
    return _OwnTensor.apply(output) if isinstance(output, torch.Tensor) else output


def embedding_outside_compile(model: nn.Module, layout: TPLayout) -> None:
    """Run the vocabulary-parallel embedding (its lookup, masking and all-reduce) outside torch.compile.

    Compiling it fails in torch 2.13 ("Mixing fake modes NYI" at the embedding: the MaskPartial
    placement keeps its mask between Dynamo's and AOTAutograd's fake modes; torchtitan issue 534),
    so a compiled forward breaks its graph there and compiles the rest. Without compile nothing changes.

    The embedding hands the compiled code a plain tensor: its all-reduced rows come out of
    ``to_local()`` as an ``AsyncCollectiveTensor``, and where such a tensor is a compiled graph's
    input (HF Llama's layers, after its graph breaks) torch 2.13 drops its autograd link, so the
    embedding got no gradient and the compiled losses left eager's from the third step.
    """
    embedding = model.get_submodule(layout.embedding)
    embedding.register_forward_hook(_plain_output)
    # _call_impl, not forward: the plan's layout changes (and the mask's reduction) are hooks around forward.
    embedding._call_impl = torch.compiler.disable(embedding._call_impl)


def hand_over_own_tensors(model: nn.Module, layout: TPLayout, sequence_parallel: bool,
                          loss_parallel: bool = False) -> None:
    """Make the plain tensors the plan hands out at the model's end (the gathered logits, with
    sequence parallel also the final norm's output) tensors of their own rather than views.

    ``DTensor.to_local()`` returns a view of the local tensor, and FSDP2 warns ("returned a view
    tensor") when a module it wraps returns one, because an in-place op on a view would drop the
    pre-backward hook FSDP puts on it: the root returns the head's logits, and in low precision the
    final norm is an FSDP group of its own. A tensor that is not a view keeps that hook through an
    in-place op; sharing storage and version counter, it costs no copy and autograd still sees
    every write. With ``loss_parallel`` the head hands out a DTensor (no ``to_local()``, no view).
    """
    names = [*([] if loss_parallel else [layout.head]), *([layout.final_norm] if sequence_parallel else [])]
    for name in names:
        model.get_submodule(name).register_forward_hook(_own_tensor_output)


# -- the built-in families ---------------------------------------------------------------------
def _is_workload(cls_name: str):
    def matches(model: nn.Module) -> bool:
        from ..workloads import gpt, llama

        cls = {"GPT": gpt.GPT, "Llama": llama.Llama}[cls_name]
        return isinstance(model, cls)

    return matches


def _workload_heads(model: nn.Module) -> dict[str, int]:
    mlp = model.blocks[0].mlp
    first = getattr(mlp, "fc", None) or getattr(mlp, "gate_proj", None)
    return {"attention heads": model.blocks[0].attn.n_head, "MLP width": first.out_features}


def _workload_local_heads(block: nn.Module, tp: int) -> None:
    block.attn.n_head //= tp  # split_heads views (B, T, d) as n_head heads: now d/tp wide


def _is_hf_llama(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == "llama" and hasattr(getattr(model, "model", None), "layers")


def _hf_heads(model: nn.Module) -> dict[str, int]:
    c = model.config
    return {"attention heads": c.num_attention_heads, "key/value heads": c.num_key_value_heads,
            "MLP width": c.intermediate_size}


for _layout in (
    TPLayout("turbotrain gpt", _is_workload("GPT"), "blocks", "attn", ("q_proj", "k_proj", "v_proj"), "out_proj",
             "mlp", ("fc",), "proj", ("ln_1", "ln_2"), "wte", "ln_f", "lm_head", _workload_heads,
             _workload_local_heads),
    TPLayout("turbotrain llama", _is_workload("Llama"), "blocks", "attn", ("q_proj", "k_proj", "v_proj"), "o_proj",
             "mlp", ("gate_proj", "up_proj"), "down_proj", ("input_layernorm", "post_attention_layernorm"),
             "embed_tokens", "norm", "lm_head", _workload_heads, _workload_local_heads),
    TPLayout("Hugging Face Llama (LlamaForCausalLM)", _is_hf_llama, "model.layers", "self_attn",
             ("q_proj", "k_proj", "v_proj"), "o_proj", "mlp", ("gate_proj", "up_proj"), "down_proj",
             ("input_layernorm", "post_attention_layernorm"), "model.embed_tokens", "model.norm", "lm_head",
             _hf_heads, None, attention_kwarg="hidden_states",
             # torch 2.13, compile=True: HF Llama's forward breaks into many graphs, and one of them returns
             # the vocabulary-sharded logits (a DTensor) next to what the loss needs; AOTAutograd's backward
             # then fails ("Expected a DTensor tangent but got a plain Tensor"; tests/test_parallel_compile.py)
             compiles_loss_parallel=False),
):
    _LAYOUTS.insert(0, _layout)
del _layout
