"""Fused linear+cross-entropy in place of the model's head, so the logits are never materialised.

The Engine finds the head by data flow (the Linear whose output is the logits the model returns),
swaps in a :class:`FusedLossHead` holding the same Parameters (same state_dict keys), and, for each
training step, arms it with the targets. Armed, the head computes the chunked linear+cross-entropy
of its input against those targets and hands the model a zero-stride placeholder of the logits'
shape (no memory), which the Engine never lets reach a loss. The model's own loss path is skipped
(``labels`` are taken out of the batch), so a Hugging Face model and a user's ``loss_fn`` are
handled alike. Where the run's own code names the targets (nanoGPT's ``forward(idx, targets)`` on
batches ``(idx, targets)`` with no loss_fn; a dict batch without ``labels`` whose model or loss_fn
reads its own keys) it keeps computing its loss: under :class:`OwnLossMode` its ``F.cross_entropy``
call on the placeholder returns the fused loss of the head's input against the targets,
``ignore_index`` and reduction that call names, so whatever the code adds to that loss stays in it.

A head the model writes out, ``F.linear(h, self.wte.weight)``, ``h @ self.wte.weight.t()`` or
``torch.einsum("btd,vd->btv", h, self.wte.weight)`` on a Parameter no Linear holds (a tied
embedding, in OLMo's and Gemma's reference code), has no module to swap: it is found by the same
data flow (:func:`find_functional_head`), stood for by a :class:`FunctionalHead` outside the model,
and the call reaches the fused head through a function mode (:func:`head_calls`) while the Engine's
forward runs; the model and its state_dict are untouched.

Whether the loss so computed equals the one the run would compute unfused is not assumed:
:func:`install_loss_head` checks it on the first batch, in the run's precision, for the loss value
and the head's weight gradient, with the targets as given and shifted by one (causal LMs), and
leaves the model as it was, with the reason, when neither matches. Before that it reads the stock
loss's autograd graph: between the head and cross-entropy's log-softmax the logits may be viewed,
cast and selected but not transformed, since a soft cap or a logit scale changes the loss little
on the small logits of an initialised model and much once training has grown them. A master-weight
mode casts the model only after all this, so :func:`recheck_loss_head` makes both checks once more on
the cast model (a forward that branches on its dtype shows only there) and rolls the head back if
it no longer passes.
"""

from __future__ import annotations

import contextlib
import math
import weakref
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..batch import IGNORE_INDEX, Batch, LossContract, check_loss, is_causal_model, model_loss
from ..plan import _logits_of, _LogSoftmaxOfHead
from ..utils import leaves_no_trace
from .modules import _compute_dtype
from .ops.linear_cross_entropy import linear_cross_entropy

__all__ = ["FusedLossHead", "FunctionalHead", "LossHeadResult", "OwnLossMode", "head_calls", "install_loss_head",
           "linear_with_own_forward",
           "functional_head_of", "install_functional_loss_head", "loss_head_refusal", "own_loss_batch",
           "through_own_call", "recheck_loss_head", "LOSS_TOLERANCES"]

#: How close the fused loss must be to the stock one, per run dtype: (relative loss error, minimum
#: SQNR of the head weight's gradient in dB). The fused kernel's GEMM rounds the logits to the run
#: dtype as the stock Linear does; the two differ in the order of the chunked reductions, and in bf16
#: and fp16 in where the model's own code casts around the head, which the bounds leave room for.
LOSS_TOLERANCES = {
    torch.float32: (1e-4, 60.0),
    torch.bfloat16: (2e-2, 20.0),
    torch.float16: (5e-3, 30.0),
}


#: Why there is nothing to fuse when no head was found.
NO_HEAD = ("no Linear produces the logits the model returns (nor F.linear or a matmul on a transposed Parameter "
           "of the model)")


def shift_left(targets: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """targets[:, 1:] padded with ``ignore_index`` at the end: position t is scored on token t+1."""
    pad = torch.full_like(targets[:, :1], ignore_index)
    return torch.cat([targets[:, 1:], pad], dim=1)


class FusedLossHead(nn.Module):
    """A Linear head that, when armed with targets, computes the fused loss instead of the logits.

    Unarmed (evaluation, generation, any call the Engine did not arm) it is exactly the Linear.
    Armed for the model's own loss (:meth:`arm_own`), it keeps its input for the cross-entropy call
    :class:`OwnLossMode` catches and returns the placeholder. ``through_loss``: the run's loss does
    more than that one cross-entropy (divides it by a token count, adds an auxiliary term), so every
    step runs that loss with its cross-entropy call answered fused, as for the model's own loss,
    instead of the head computing the whole loss.
    """

    def __init__(self, linear: nn.Module, shift: bool, chunk_rows: Optional[int] = None,
                 ignore_index: int = IGNORE_INDEX, reduction: str = "mean", through_loss: bool = False):
        super().__init__()
        self.through_loss = through_loss
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.shift = shift
        self.chunk_rows = chunk_rows
        self.ignore_index, self.reduction = ignore_index, reduction  # of the loss it replaces
        self._targets: Optional[Tensor] = None
        self._loss: Optional[Tensor] = None
        self._own = False
        self._input: Optional[tuple] = None  # (x, w, b) in the compute dtype, for the model's own loss
        # The FunctionalHead this head stands in for (not a submodule: it is reached through head_calls).
        self.__dict__["site"] = linear if isinstance(linear, FunctionalHead) else None

    def arm(self, targets: Tensor) -> None:
        self._targets = targets
        self._loss = None

    def arm_own(self) -> None:
        """The next forward's model computes its own cross-entropy under :class:`OwnLossMode`."""
        self._own, self._input = True, None

    def disarm(self) -> None:
        self._own, self._input, self._targets, self._loss = False, None, None, None

    def take_loss(self) -> Tensor:
        loss, self._loss, self._targets = self._loss, None, None
        if loss is None:
            from ..errors import FusionError

            raise FusionError("the fused loss head was armed but the model's forward never called it; "
                              "train without fuse=('linear_cross_entropy',) for this model")
        return loss

    def _operands(self, x: Tensor, w: Tensor, b: Optional[Tensor]) -> tuple:
        dtype = _compute_dtype(x, w)
        if dtype is not None:  # custom ops are not cast by autocast (or the mode): do what they would
            x, w = x.to(dtype), w.to(dtype)
            b = b.to(dtype) if b is not None else None
        return x, w, b

    def forward(self, x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
        """``weight`` and ``bias`` are given for a :class:`FunctionalHead`'s call: the Parameters the
        model's own ``F.linear`` was handed (FSDP gathers them anew each forward)."""
        targets = self._targets
        w, b = (self.weight, self.bias) if weight is None else (weight, bias)
        if self._own:
            self._input = self._operands(x, w, b)
        elif targets is None:
            return F.linear(x, w, b)
        else:
            self._targets = None
            if self.shift:
                targets = shift_left(targets, self.ignore_index)
            self._loss = linear_cross_entropy(*self._operands(x, w, b), targets, self.ignore_index, self.chunk_rows,
                                              self.reduction)
        # The model goes on with a placeholder of the logits' shape that costs no memory.
        return x.new_zeros(()).expand(*x.shape[:-1], self.out_features)

    def is_placeholder(self, value) -> bool:
        """``value`` is this forward's placeholder logits, or a view of all of them (``.view(-1, V)``)."""
        if self._input is None or not isinstance(value, Tensor) or value.dim() < 1:
            return False
        x = self._input[0]
        return (value.shape[-1] == self.out_features and value.numel() == x.numel() // x.shape[-1] * self.out_features
                and all(s == 0 for s in value.stride()))

    def own_loss(self, target: Tensor, ignore_index: int, reduction: str, label_smoothing: float = 0.0,
                 class_weight: Optional[Tensor] = None) -> Tensor:
        """The fused cross-entropy of the kept input against ``target`` (one class index per logits row),
        with F.cross_entropy's ``label_smoothing`` and class ``weight`` where the call names them."""
        x, w, b = self._input
        rows = x.reshape(-1, x.shape[-1])
        target = target.reshape(-1)
        return linear_cross_entropy(rows, w, b, target, ignore_index, self.chunk_rows, reduction,
                                    label_smoothing, class_weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fused cross-entropy{' (causal shift)' if self.shift else ''}")


class FunctionalHead(nn.Module):
    """The head of a model that computes its logits as ``F.linear(h, W)`` (or ``F.linear(h, W, b)``) on
    Parameters held by modules that are not a Linear: a tied embedding written out
    (``F.linear(x, self.wte.weight)``, as OLMo's code does). Not part of the model (its state_dict is
    untouched): the model's call reaches it, or the :class:`FusedLossHead` built on it, through
    :func:`head_calls`. ``weight`` and ``bias`` are looked up on their modules at each use, so a transform
    that replaces those Parameters (FSDP) is followed."""

    def __init__(self, model: nn.Module, weight_name: str, bias_name: Optional[str] = None):
        super().__init__()
        self.name = weight_name
        self._at = tuple(None if n is None else (model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
                         for n in (weight_name, bias_name))
        self.out_features, self.in_features = self.weight.shape

    @property
    def weight(self) -> Tensor:
        owner, attr = self._at[0]
        return getattr(owner, attr)

    @property
    def bias(self) -> Optional[Tensor]:
        return None if self._at[1] is None else getattr(*self._at[1])

    @property
    def site(self) -> "FunctionalHead":
        return self

    def forward(self, x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
        return F.linear(x, self.weight if weight is None else weight, bias)

    def extra_repr(self) -> str:
        return f"F.linear on {self.name}, in_features={self.in_features}, out_features={self.out_features}"


_LINEAR_ARGS = ("input", "weight", "bias")


_MATMULS = frozenset({torch.matmul, Tensor.matmul, Tensor.__matmul__})


def transposed_parameter(t) -> Optional[Tensor]:
    """The 2-d tensor ``t`` is the transpose of (``w.t()``, ``w.T``, ``w.mT``, ``w.transpose(0, 1)``), or
    None. Read off the view's base, not the call that made it: under torch.compile a ``.T`` does not
    reach a function mode."""
    base = t._base if isinstance(t, Tensor) else None
    if base is None or t.dim() != 2 or base.dim() != 2:
        return None
    if tuple(t.shape) != tuple(base.shape)[::-1] or tuple(t.stride()) != tuple(base.stride())[::-1]:
        return None
    return base


def einsum_as_linear(args) -> Optional[tuple]:
    """``(x, W)`` when ``torch.einsum(*args)`` is ``x @ W.t()`` over the last dimension of ``x``
    (``"btd,vd->btv"`` or ``"...d,vd->...v"``, spaces allowed, as einops-minded code writes a tied
    head); else None."""
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        args = (args[0], *args[1])
    if len(args) != 3 or not isinstance(args[0], str) or not all(isinstance(t, Tensor) for t in args[1:]):
        return None
    inputs, arrow, out = args[0].replace(" ", "").partition("->")
    a, comma, b = inputs.partition(",")
    if a.startswith("...") and out.startswith("..."):  # the leading dimensions, however many, pass through
        a, out = a[3:], out[3:]
    if (not arrow or not comma or not a or not (a + b + out).isalpha() or len(set(a)) != len(a) or len(b) != 2
            or b[1] != a[-1] or b[0] in a or out != a[:-1] + b[0]):
        return None
    return args[1], args[2]


class _HeadCalls(TorchFunctionMode):
    """While the model runs: its ``F.linear`` call on a :class:`FunctionalHead`'s Parameters, or its
    matmul with the transposed weight (``h @ W.t()``) or the einsum that computes it, goes to
    ``module`` (the FunctionalHead itself, or the FusedLossHead built on it)."""

    def __init__(self, site: FunctionalHead, module: nn.Module):
        super().__init__()
        self.site, self.module = site, module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            bound = dict(zip(_LINEAR_ARGS, args), **kwargs)
            if bound.get("weight") is self.site.weight and bound.get("bias") is self.site.bias:
                return self.module(bound["input"], weight=bound["weight"], bias=bound.get("bias"))
        elif self.site.bias is None and not kwargs:
            if func in _MATMULS and len(args) == 2 and transposed_parameter(args[1]) is self.site.weight:
                return self.module(args[0], weight=self.site.weight)
            if func is torch.einsum:
                xw = einsum_as_linear(args)
                if xw is not None and xw[1] is self.site.weight:
                    return self.module(xw[0], weight=self.site.weight)
        return func(*args, **kwargs)


class _FunctionalLinears(TorchFunctionMode):
    """Records, into ``outputs``, each ``F.linear`` output whose weight is one of ``names`` (the
    model's Parameters that no Linear holds), under ``(weight name, bias name)``; and each matmul
    with the transpose of such a Parameter (``h @ W.t()``), or einsum computing it, under
    ``(weight name, None)``."""

    def __init__(self, names: dict, outputs: dict):
        super().__init__()
        self.names, self.outputs = names, outputs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor):
            return out
        if func in _MATMULS and len(args) == 2 or func is torch.einsum:
            xw = einsum_as_linear(args) if func is torch.einsum else (args[0], transposed_parameter(args[1]))
            weight = None if xw is None else self.names.get(id(xw[1]))
            if weight is not None:
                self.outputs[out.data_ptr()] = ((weight, None), weakref.ref(out))
        elif func is F.linear:
            bound = dict(zip(_LINEAR_ARGS, args), **kwargs)
            weight, bias = self.names.get(id(bound.get("weight"))), bound.get("bias")
            bias_name = None if bias is None else self.names.get(id(bias))
            if weight is not None and (bias is None or bias_name is not None):
                self.outputs[out.data_ptr()] = ((weight, bias_name), weakref.ref(out))
        return out


def linear_with_own_forward(module: nn.Module) -> bool:
    """``module`` is a subclass of nn.Linear with a forward of its own (modded-nanogpt's ``CastedLinear``,
    ``F.linear(x, self.weight.type_as(x))``; muP's readout, which scales its input first), not
    parametrized. Swapping a fused head in would drop what that forward does; its ``F.linear`` call on
    its own weight is answered instead, as a :class:`FunctionalHead`'s, so the rest runs as written."""
    from torch.nn.utils import parametrize

    return (isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward
            and not parametrize.is_parametrized(module))


def own_forward_unanswered(head: nn.Module) -> str:
    """Why a Linear subclass with its own forward (:func:`linear_with_own_forward`) is not fused when no
    ``F.linear`` call on its weight was seen."""
    return (f"the head is a {type(head).__name__} whose own forward does not call F.linear on its weight as it "
            "is (a cast to another dtype or a transform of the weight makes a new tensor), so there is no call "
            "to answer with the fused head")


def find_functional_head(model: nn.Module, run) -> Optional[tuple[str, Optional[str]]]:
    """(weight name, bias name or None) of the ``F.linear`` call whose output is the logits the model
    returns, where that weight is a Parameter no Linear holds: a tied embedding written out,
    ``F.linear(x, self.wte.weight)`` or ``x @ self.wte.weight.t()``. Found by data flow, as
    :func:`~turbotrain.plan.find_head` finds a Linear (the log-softmax of the logits, or the whole
    output a ``F.cross_entropy`` took, count as well)."""
    in_linears = {id(p) for m in model.modules() if isinstance(m, nn.Linear) and not linear_with_own_forward(m)
                  for p in m.parameters(recurse=False)}
    names = {id(p): n for n, p in model.named_parameters() if id(p) not in in_linears}
    if not names:
        return None
    outputs: dict = {}
    with torch.no_grad(), leaves_no_trace(model), _FunctionalLinears(names, outputs), \
            _LogSoftmaxOfHead(outputs) as mode:
        logits = _logits_of(run())
    if logits is None:
        return mode.scored
    found, ref = outputs.get(logits.data_ptr(), (None, None))
    return found if ref is not None and ref() is not None else None


def head_calls(head: nn.Module) -> contextlib.AbstractContextManager:
    """Around a forward: routes the model's own ``F.linear`` head call to ``head`` where the head is
    functional (:class:`FunctionalHead`, or a FusedLossHead built on one); a Linear module needs nothing."""
    site = getattr(head, "site", None)
    return _HeadCalls(site, head) if site is not None else contextlib.nullcontext()


_CROSS_ENTROPY_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                       "label_smoothing")


def _cross_entropy_call(args, kwargs) -> dict:
    """An ``F.cross_entropy`` call's arguments by name."""
    return dict(zip(_CROSS_ENTROPY_ARGS, args), **kwargs)


#: Tensor methods that only change the dtype (or device) of the logits on their way to the loss.
_CASTS = frozenset({Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.to, Tensor.type_as,
                    Tensor.type})


class OwnLossMode(TorchFunctionMode):
    """While a model computes its own loss: ``F.cross_entropy`` on the fused head's placeholder logits
    (``nn.CrossEntropyLoss`` calls it too) returns the fused loss; every other call runs as it is.

    ``calls`` counts the cross-entropies it answered (the same logits may be scored more than once).
    Its ``label_smoothing`` and class ``weight`` are the fused kernel's too. One it cannot answer the same
    way (a per-token loss, class probabilities as targets) raises
    :class:`~turbotrain.errors.FusionError`, which the set-up's loss check turns into a rollback with
    that reason.
    """

    def __init__(self, head: FusedLossHead):
        super().__init__()
        self.head = head
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            bound = _cross_entropy_call(args, kwargs)
            logits = bound.get("input")
            if (isinstance(logits, Tensor) and logits.dim() >= 3 and not self.head.is_placeholder(logits)
                    and self.head.is_placeholder(logits.movedim(1, -1))):
                # F.cross_entropy(logits.transpose(1, 2), y): the classes on dim 1, the targets (N, T);
                # a layout other than that transpose gives another loss, which the set-up's check sees
                bound["input"] = logits.movedim(1, -1)
            if self.head.is_placeholder(bound.get("input")):
                return self._fused(bound)
        elif func in _CASTS and args and self.head.is_placeholder(args[0]):
            # logits.float() (Meta's Llama code) would turn the placeholder into a tensor of zeros:
            # cast a 0-d stand-in instead and hand back a placeholder in the new dtype
            out = func(args[0].new_zeros(()), *args[1:], **kwargs)
            return out.expand(args[0].shape) if isinstance(out, Tensor) else out
        return func(*args, **kwargs)

    def _fused(self, bound: dict) -> Tensor:
        from ..errors import FusionError

        reduction = bound.get("reduction", "mean")
        unlike = [name for name, stock in (("size_average", None), ("reduce", None)) if bound.get(name) is not stock]
        if reduction not in ("mean", "sum"):
            unlike.append(f"reduction={reduction!r}")
        if unlike:
            raise FusionError(f"the model's cross-entropy uses {', '.join(unlike)}, which the fused head "
                              "does not compute")
        target = bound["target"]
        if not isinstance(target, Tensor) or target.is_floating_point():
            raise FusionError("the model's cross-entropy takes class probabilities, not class indices")
        self.calls += 1
        return self.head.own_loss(target, int(bound.get("ignore_index", IGNORE_INDEX)), reduction,
                                  float(bound.get("label_smoothing", 0.0)), bound.get("weight"))


class _SettledCrossEntropies(TorchFunctionMode):
    """Records each ``F.cross_entropy`` call (``nn.CrossEntropyLoss`` makes one) that uses
    ``label_smoothing`` or ``weight=``, as ``{its output's autograd node: its input's}``.

    Inside such a call the autograd graph shows more than a log-softmax under one nll_loss (the
    smoothing's sum over every class's log-probability), which read node by node looks like a loss
    the fused kernel cannot compute. Seen as one call, with its settings known, it is one the kernel
    computes (:class:`OwnLossMode` passes them on), so the graph walk steps over it.
    """

    def __init__(self):
        super().__init__()
        self.calls: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.cross_entropy:
            bound = _cross_entropy_call(args, kwargs)
            weight, logits = bound.get("weight"), bound.get("input")
            settled = float(bound.get("label_smoothing", 0.0)) != 0.0 or weight is not None
            if (settled and isinstance(out, Tensor) and out.grad_fn is not None and isinstance(logits, Tensor)
                    and logits.grad_fn is not None and not (isinstance(weight, Tensor) and weight.requires_grad)):
                self.calls[out.grad_fn] = logits.grad_fn
        return out


def through_own_call(batch: Batch, head: FusedLossHead) -> bool:
    """The run's own cross-entropy call is the one the fused head answers (:func:`own_loss`): the run's
    code names its targets (:func:`own_loss_batch`), or its loss does more than that cross-entropy."""
    return own_loss_batch(batch) or head.through_loss


def own_loss_batch(batch: Batch) -> bool:
    """The run's own code names the targets of its cross-entropy, so the fused head cannot be armed with
    them: ``(inputs, targets)`` with no loss_fn (nanoGPT's ``forward(idx, targets)``), a dict without
    ``labels`` (a model or loss_fn that reads its own keys), or a single tensor."""
    if batch.kind == "tuple":
        return len(batch.args) == 2
    return batch.kind == "tensor" or "labels" not in batch.kwargs


def own_loss(model: nn.Module, head: FusedLossHead, batch: Batch, contract: LossContract) -> Tensor:
    """The run's loss of ``batch`` (the model's own, or the loss_fn's) with its cross-entropy on the
    head's logits computed fused."""
    from ..errors import FusionError

    head.arm_own()
    try:
        with OwnLossMode(head) as mode:
            loss = contract(model, batch)
        if not mode.calls:
            raise FusionError(f"{contract.source} computed no cross-entropy on the whole of the head's logits "
                              "(one on a slice or a transformed copy of them cannot be fused); train without "
                              "fuse=('linear_cross_entropy',) for this model")
        return loss
    finally:
        head.disarm()


@dataclass
class LossHeadResult:
    path: str
    fused: bool
    reason: str = ""
    shift: bool = False
    loss_rel_error: float = math.nan
    grad_sqnr_db: float = math.nan
    grad_of: str = "weight"
    """Whose gradient the check compared: the head's weight, or its input where the weight is frozen."""
    through_loss: bool = False
    """The run's loss does more than the one cross-entropy, so its own call is answered fused."""
    checked_in: Optional[torch.dtype] = None
    """The dtype of the head's weight when the figures above were taken (set-up's check, or the second
    check on the model cast to bf16/fp16 by a master-weight mode)."""


def loss_targets(batch: Batch, model: Optional[nn.Module] = None) -> tuple[Optional[Tensor], Batch]:
    """The targets the fused head scores against, and the batch the model is then called with.

    A mapping gives up its ``labels`` (so the model does not compute its own loss on the
    placeholder); an encoder-decoder model (T5, BART) that made its decoder inputs from them gets
    those decoder inputs instead. The tuple contract keeps its targets aside already.
    """
    if batch.kind == "mapping":
        if "labels" not in batch.kwargs:
            return None, batch
        kwargs = dict(batch.kwargs)
        labels = kwargs.pop("labels")
        prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
        if (callable(prepare) and getattr(getattr(model, "config", None), "is_encoder_decoder", False)
                and kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None):
            kwargs["decoder_input_ids"] = prepare(labels=labels)
        return labels, Batch((), kwargs, kind="mapping", size=batch.size)
    if batch.kind == "tuple":  # with a loss_fn, or the model's own loss (own_loss_batch)
        return batch.targets, batch
    return None, batch


def _first_rows(batch: Batch, rows: int) -> Batch:
    from torch.utils._pytree import tree_map_only

    def cut(t):
        return t[:rows] if t.dim() and t.shape[0] == batch.size else t

    return Batch(tree_map_only(Tensor, cut, batch.args), tree_map_only(Tensor, cut, batch.kwargs),
                 tree_map_only(Tensor, cut, batch.targets), kind=batch.kind, size=min(rows, batch.size or rows))


#: Autograd nodes that may stand between the head's output and the loss's log-softmax: they move,
#: cast or select logits but compute nothing from them.
_CARRIERS = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0", "CloneBackward0",
    "ToCopyBackward0", "TransposeBackward0", "TransposeBackward1", "TBackward0", "PermuteBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0", "SliceBackward0",
    "SelectBackward0", "IndexBackward0", "SplitBackward0", "SplitWithSizesBackward0", "UnbindBackward0",
    "NarrowBackward0",
})
_LOG_SOFTMAX = frozenset({"LogSoftmaxBackward0"})
_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})  # the second: class dim 1 (N, C, T) input
#: Per-token picks of the target's log-probability, whose weighting or masking before the mean the
#: fused head cannot follow (a first batch without padding would not show the difference).
_PER_TOKEN_PICKS = frozenset({"GatherBackward0", "IndexBackward0"})
#: Below the log-softmax: a selection of positions (``logits[:, -1]``, ``logits[mask]``), which the
#: fused head, scoring every row it computes, cannot follow (a slice, the causal shift, it can).
_POSITION_PICKS = frozenset({"SelectBackward0", "IndexBackward0"})
#: nll_loss's reduction as its autograd node saves it (torch's Reduction enum).
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _is_identity_scale(node) -> bool:
    """``logits * 1`` or ``logits / 1`` (a model's configurable logit scale left at one)."""
    if type(node).__name__ not in ("MulBackward0", "DivBackward0"):
        return False
    other = getattr(node, "_saved_other", None)
    return isinstance(other, Tensor) and other.numel() == 1 and float(other) == 1.0


def logits_feed_only_the_log_softmax(loss: Tensor, logits: Tensor, nll: Optional[list] = None,
                                     settled: Optional[dict] = None, stepped: Optional[list] = None) -> str:
    """Why the fused head would not compute what ``loss`` computes from ``logits``, or "" if it would.

    The fused kernel is cross-entropy on the head's raw output. So on every path of the autograd graph
    from the loss down to the logits, the ops below the log-softmax of cross-entropy may only carry the
    logits (views, casts, copies, selections), never transform them: a soft cap (``tanh(z/c)*c``),
    a temperature or logit scale, a z-loss on the logits, all of which a loss check at initialisation
    (small logits) can miss, are refused here. So are losses that use more of the log-probabilities
    than the target's (label smoothing), weigh the classes, or weigh or mask the per-token losses
    themselves (``reduction='none'``, ``gather``): a first batch can agree with the fused loss by
    chance (no padding in it) where later ones would not. ``nll`` collects the nll_loss nodes (their
    ignore_index and reduction are the fused loss's). ``settled`` maps the output node of each
    ``F.cross_entropy`` call with label smoothing or class weights to its input's node
    (:class:`_SettledCrossEntropies`): the walk steps over such a call, which the kernel computes with
    those settings, to its input, and appends the output node to ``stepped``.
    """
    settled = settled or {}
    target = logits.grad_fn
    if target is None or loss.grad_fn is None:
        return "the logits or the loss carry no autograd graph to inspect"
    reaches: dict = {}

    def reaches_target(node) -> bool:  # iterative, memoised: the graph of a deep model is deep
        stack = [node]
        while stack:
            n = stack[-1]
            if n in reaches:
                stack.pop()
                continue
            children = [c for c, _ in n.next_functions if c is not None]
            pending = [c for c in children if c not in reaches and c is not target]
            if pending:
                stack.extend(pending)
                continue
            reaches[n] = n is target or any(c is target or reaches[c] for c in children)
            stack.pop()
        return reaches[node]

    reaches[target] = True
    if not reaches_target(loss.grad_fn):
        return "the logits do not reach the loss in its autograd graph"
    seen, stack = set(), [(loss.grad_fn, False, False)]
    while stack:
        node, below, picked = stack.pop()
        if (node, below, picked) in seen:
            continue
        seen.add((node, below, picked))
        if node is target:
            if not below:
                return "the logits reach the loss other than through cross-entropy's log-softmax"
            continue
        if not below and not picked and node in settled:  # F.cross_entropy(label_smoothing=, weight=)
            if stepped is not None:
                stepped.append(node)
            stack.append((settled[node], True, True))
            continue
        name = type(node).__name__
        if below and name in _POSITION_PICKS:
            return ("the loss scores a selection of the logits' positions (logits[:, -1], an index or a mask), "
                    "while the fused head scores every position it computes")
        if below and name not in _CARRIERS and not _is_identity_scale(node):
            return f"the logits pass through {name.removesuffix('Backward0')} before the loss's log-softmax"
        if not below and name in _LOG_SOFTMAX and not picked:
            # a term over every class's log-probability: label smoothing (F.cross_entropy's or written
            # out), whose gradient share (~the smoothing factor) a bf16 check's 20 dB can let through
            return ("the loss uses the log-probabilities of classes other than the target (label smoothing written "
                    "out, or a sum over the classes), which the fused cross-entropy does not compute; "
                    "F.cross_entropy(..., label_smoothing=s) it does")
        if not picked and name in _PER_TOKEN_PICKS:
            return ("the loss picks the targets' log-probabilities itself (gather or indexing) and may weigh or "
                    "mask them, which the fused cross-entropy does not follow; use F.cross_entropy or F.nll_loss")
        if not picked and name in _NLL:
            if getattr(node, "_saved_weight", None) is not None:
                return ("the loss weights the classes with nll_loss's weight= (or a weight that trains), which the "
                        "fused cross-entropy does not follow; F.cross_entropy(..., weight=w) it does")
            if _REDUCTIONS.get(getattr(node, "_saved_reduction", 1)) not in ("mean", "sum"):
                return ("the loss keeps per-token losses (reduction='none') and reduces them itself, which the "
                        "fused cross-entropy does not follow")
            if nll is not None:
                nll.append(node)
        now_below = below or name in _LOG_SOFTMAX
        now_picked = picked or name in _NLL
        stack.extend((c, now_below, now_picked) for c, _ in node.next_functions
                     if c is not None and reaches.get(c, False))
    return ""


def loss_is_the_cross_entropy(loss: Tensor, nll) -> bool:
    """``loss`` is the output of the cross-entropy whose nll_loss node is ``nll`` as it is (viewed or
    cast), not scaled, divided (``reduction='sum'`` over a token count) or added to."""
    node = loss.grad_fn
    while node is not nll:
        children = [c for c, _ in node.next_functions if c is not None]
        if len(children) != 1 or (type(node).__name__ not in _CARRIERS and not _is_identity_scale(node)):
            return False
        node = children[0]
    return True


def loss_has_other_term(loss: Tensor, logits: Tensor) -> bool:
    """Some gradient path from ``loss`` to a parameter does not run through ``logits``.

    A term the loss adds that does not come from the logits (a mixture-of-experts router's
    load-balancing loss, a regulariser on hidden states, a second head's loss) would be lost if the
    fused head computed the whole loss from the targets; at initialisation such a term can be well
    inside the bf16 loss check's tolerance. Such a loss has its own cross-entropy call answered instead.
    """
    target, stack, seen = logits.grad_fn, [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node is target or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":
            return True
        stack.extend(child for child, _ in node.next_functions)
    return False


def _nll_settings(nodes: list) -> tuple[dict, str]:
    """The (ignore_index, reduction) the fused loss must use, from the loss's nll_loss node; or why not."""
    if len(nodes) != 1:
        return {}, f"the loss has {len(nodes)} cross-entropy terms on the logits, not one"
    node = nodes[0]
    ignore = int(getattr(node, "_saved_ignore_index", IGNORE_INDEX))
    if ignore >= 2**63:  # torch 2.13's autograd node hands the saved int64 back as unsigned (-1 as 2**64 - 1)
        ignore -= 2**64
    return {"ignore_index": ignore,
            "reduction": _REDUCTIONS[getattr(node, "_saved_reduction", 1)]}, ""


def _run(model, head, contract: LossContract, batch: Batch, context, fused: Optional[FusedLossHead]):
    """Loss and head gradient of one seeded run; for the stock run also why the fused head would
    compute something else ("" if not), read off the autograd graph before the gradient frees it, and
    the ignore_index and reduction of its cross-entropy.

    The gradient is the head weight's, or where the head is frozen (a LoRA fine-tune, a tied frozen
    embedding) its input's, which the fused kernel computes just the same."""
    seen, nll, settings, inputs, stepped = [], [], {}, [], []
    recorder = _SettledCrossEntropies() if fused is None else contextlib.nullcontext()
    hook = head.register_forward_hook(lambda mod, args, out: seen.append(out)) if fused is None else None
    in_hook = head.register_forward_pre_hook(lambda mod, args: inputs.append(args[0] if args else None))
    try:
        with leaves_no_trace(model):
            with context(), head_calls(head):
                torch.manual_seed(0)  # same dropout masks in the stock and the fused run
                if fused is None:
                    with recorder:
                        loss = contract(model, batch)
                    loss = check_loss(loss, contract.source)  # a bad loss is the user's to fix
                elif through_own_call(batch, fused):
                    loss = own_loss(model, fused, batch, contract)
                else:
                    targets, call = loss_targets(batch, model)
                    fused.arm(targets)
                    model(*call.args, **call.kwargs)
                    loss = fused.take_loss()
            why = ""
            if fused is None and len(seen) == 1 and isinstance(seen[0], Tensor):
                why = logits_feed_only_the_log_softmax(loss, seen[0], nll, recorder.calls, stepped)
                if not why and not own_loss_batch(batch) and stepped:
                    # label smoothing or class weights: the loss's own call, with its settings, is answered
                    settings = {"through_loss": True}
                elif not why and not own_loss_batch(batch):  # the model's own loss keeps its own terms and settings
                    settings, why = _nll_settings(nll)
                    if not why and (not loss_is_the_cross_entropy(loss, nll[0])
                                    or loss_has_other_term(loss, seen[0])):
                        # the loss scales the cross-entropy or adds to it: keep all of it, answer its call
                        settings = {"through_loss": True}
            elif fused is None:
                why = f"the head ran {len(seen)} times in one forward"
            wrt = head.weight if head.weight.requires_grad else inputs[0] if len(inputs) == 1 else None
            if isinstance(wrt, Tensor) and wrt.requires_grad:
                (grad,) = torch.autograd.grad(loss, [wrt])
            else:
                grad, why = None, why or "nothing the head's loss reaches trains (its weight and its input are frozen)"
    finally:
        in_hook.remove()
        if hook is not None:
            hook.remove()
    return loss.detach().float(), None if grad is None else grad.detach(), why, settings


def _unfit(model: nn.Module, head_path: str, example: Batch) -> str:
    """Why the head or the batch rules the fused loss out before anything runs ("" if nothing does)."""
    from torch.nn.utils import parametrize

    head = model.get_submodule(head_path)
    if not isinstance(head, nn.Linear):
        return f"the head is a {type(head).__name__}, not an nn.Linear"
    if parametrize.is_parametrized(head):  # spectral_norm, weight_norm, orthogonal: a weight made anew each call
        return (f"the head's weight is computed by a parametrization ({', '.join(head.parametrizations)}) at each "
                "call, which the fused head would not recompute")
    extra = sorted({n for n, _ in head.named_parameters()} - {"weight", "bias"}
                   | {n for n, _ in head.named_buffers()} | {n for n, _ in head.named_children()})
    if extra:
        return (f"the head is a {type(head).__name__} that holds {', '.join(extra)} besides its weight and bias, "
                "which the fused head would drop")
    why = _unfit_targets(example)
    if why:
        return why
    if not head_path:
        return "the model itself is the head"
    return ""


def _unfit_targets(example: Batch) -> str:
    targets, _ = loss_targets(example)
    if not own_loss_batch(example) and (
            not isinstance(targets, Tensor) or targets.is_floating_point() or targets.dim() < 1):
        return "the targets are not integer class indices"
    return ""


def functional_head_of(model: nn.Module, example: Batch, context=contextlib.nullcontext) -> Optional[FunctionalHead]:
    """The :class:`FunctionalHead` of a model that computes its logits with ``F.linear`` (or a matmul with
    a transposed Parameter) on a Parameter no Linear holds, found by running ``example``; else None."""
    with context():
        found = find_functional_head(model, lambda: model(*example.args, **example.kwargs))
    return None if found is None else FunctionalHead(model, *found)


def loss_head_refusal(model: nn.Module, head_path: Optional[str], contract: LossContract, example: Batch,
                      context=contextlib.nullcontext) -> str:
    """Why the fused linear+cross-entropy could not replace the loss the run computes, "" if nothing says so.

    The checks :func:`install_loss_head` makes before it tries the fused head (the head, the targets, the
    stock loss's autograd graph), on two rows of ``example``, leaving the model and the random stream as
    they were; without a Linear head (``head_path`` None) those of a head written as ``F.linear``. "" is
    not a promise: the set-up's loss check can still roll the head back.
    """
    if head_path is None or linear_with_own_forward(model.get_submodule(head_path)):
        head = functional_head_of(model, example, context)
        if head is None:
            return NO_HEAD if head_path is None else own_forward_unanswered(model.get_submodule(head_path))
        why = _unfit_targets(example)
    else:
        why = _unfit(model, head_path, example)
        head = model.get_submodule(head_path)
    if why:
        return why
    return _run(model, head, contract, _first_rows(example, 2), context, None)[2]


def install_loss_head(model: nn.Module, head_path: str, contract: LossContract, example: Batch,
                      run_dtype: torch.dtype, context=contextlib.nullcontext) -> tuple[LossHeadResult, Optional[FusedLossHead]]:
    """Swap a FusedLossHead in at ``head_path`` if it reproduces the run's loss on ``example``."""
    why = _unfit(model, head_path, example)
    if why:
        return LossHeadResult(head_path, False, why), None
    head = model.get_submodule(head_path)
    owner_path, _, name = head_path.rpartition(".")
    owner = model.get_submodule(owner_path)
    return _install(model, head, head_path, contract, example, run_dtype, context, lambda m: setattr(owner, name, m))


def install_functional_loss_head(model: nn.Module, head: FunctionalHead, contract: LossContract, example: Batch,
                                 run_dtype: torch.dtype, context=contextlib.nullcontext
                                 ) -> tuple[LossHeadResult, Optional[FusedLossHead]]:
    """A FusedLossHead for a head the model computes with ``F.linear`` (:class:`FunctionalHead`), if it
    reproduces the run's loss on ``example``; the Engine's forward then routes that call to it
    (:func:`head_calls`). Nothing in the model changes."""
    path = f"{head.name} (F.linear)"
    why = _unfit_targets(example)
    if why:
        return LossHeadResult(path, False, why), None
    return _install(model, head, path, contract, example, run_dtype, context, lambda m: None)


def _agreement(ref_loss: Tensor, ref_grad: Tensor, loss: Tensor, grad: Tensor, dtype: torch.dtype
               ) -> tuple[float, float, str]:
    """The fused run's relative loss error and head-gradient SQNR against the stock run's, and why they
    fall outside ``dtype``'s tolerances ("" when they do not)."""
    from .rewrite import sqnr

    rel_bound, sqnr_bound = LOSS_TOLERANCES.get(dtype, LOSS_TOLERANCES[torch.float32])
    rel = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-12)
    ratio = sqnr(ref_grad, grad)
    if rel <= rel_bound and ratio >= sqnr_bound:
        return rel, ratio, ""
    return rel, ratio, (f"loss off by {rel:.2g} (allowed {rel_bound:g}), head grad SQNR {ratio:.1f} dB "
                        f"(needs {sqnr_bound:g})")


def _install(model: nn.Module, head: nn.Module, path: str, contract: LossContract, example: Batch,
             run_dtype: torch.dtype, context, put) -> tuple[LossHeadResult, Optional[FusedLossHead]]:
    """Try the fused head built on ``head`` (``put`` puts a module in the head's place), both target
    alignments where the targets could be either, against the stock loss on two rows of ``example``."""
    targets, _ = loss_targets(example)
    sample = _first_rows(example, 2)
    ref_loss, ref_grad, why, settings = _run(model, head, contract, sample, context, None)
    if why:
        return LossHeadResult(path, False, why), None
    causal_first = is_causal_model(model) and example.kind == "mapping"
    tried = []
    # The model's own cross-entropy names its targets itself: nothing to shift.
    through = own_loss_batch(example) or settings.get("through_loss", False)
    shifts = (False,) if through else (True, False) if causal_first else (False, True)
    for shift in shifts:
        if shift and targets.dim() < 2:
            continue
        fused = FusedLossHead(head, shift, **settings)
        # What recheck_loss_head needs to compare again and roll back (plain attributes, not submodules).
        fused.__dict__.update(_stock=head, _put=put)
        put(fused)
        try:
            loss, grad, _, _ = _run(model, fused, contract, sample, context, fused)
        except Exception as exc:  # noqa: BLE001 - the user's forward may not run this way; report it
            put(head)
            return LossHeadResult(path, False, f"the fused head could not run ({type(exc).__name__}: {exc})"), None
        rel, ratio, off = _agreement(ref_loss, ref_grad, loss, grad, run_dtype)
        if not off:
            return LossHeadResult(path, True, shift=shift, loss_rel_error=rel, grad_sqnr_db=ratio,
                                  grad_of="weight" if head.weight.requires_grad else "input",
                                  checked_in=head.weight.dtype, through_loss=fused.through_loss), fused
        put(head)
        tried.append(f"{'shifted' if shift else 'as given'}: {off}")
    return LossHeadResult(path, False, "the fused loss does not reproduce the run's loss ("
                          + "; ".join(tried) + "); the loss may do more than cross-entropy on the logits"), None


def recheck_loss_head(model: nn.Module, fused: FusedLossHead, result: LossHeadResult, contract: LossContract,
                      example: Batch, context=contextlib.nullcontext) -> LossHeadResult:
    """The set-up's loss check again, on the model as it will run: a master-weight mode casts it to
    bf16/fp16 after fusion checked it in FP32, and a forward that branches on its dtype (a ``.float()``
    on the logits) shows only then. On a mismatch the stock head is put back and the result says why;
    else the figures are the run dtype's."""
    stock, put = fused.__dict__["_stock"], fused.__dict__["_put"]
    dtype = fused.weight.dtype
    sample = _first_rows(example, 2)
    put(stock)
    try:
        ref_loss, ref_grad, why, _ = _run(model, stock, contract, sample, context, None)
    finally:
        put(fused)
    if not why:
        try:
            loss, grad, _, _ = _run(model, fused, contract, sample, context, fused)
        except Exception as exc:  # noqa: BLE001 - the user's forward may not run this way; report it
            why = f"the fused head could not run ({type(exc).__name__}: {exc})"
        else:
            rel, ratio, why = _agreement(ref_loss, ref_grad, loss, grad, dtype)
            if not why:
                return dataclasses.replace(result, loss_rel_error=rel, grad_sqnr_db=ratio, checked_in=dtype)
    put(stock)
    return LossHeadResult(result.path, False, f"checked again with the model in {str(dtype).removeprefix('torch.')}: "
                          + why)
