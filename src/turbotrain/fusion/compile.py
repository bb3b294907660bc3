"""torch.compile with few shapes: sequence-length buckets, and a watch on recompiles.

Every new sequence length makes a ``dynamic=False`` compile build a new graph, and after
``torch._dynamo.config.recompile_limit`` graphs for one function Dynamo gives up and runs it
eagerly. Padding batches up to a few bucket lengths bounds the graphs at ``len(buckets)``.

>>> bucket_length(100, (64, 128, 256))
128
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
import weakref

import torch

from ..batch import bucket_length
from ..plan import Transform
from .ops._kernels import epilogue_frames

__all__ = ["bucket_length", "recompile_count", "recompile_limit", "check_recompile_budget", "most_compiled_function",
           "CompileTransform"]

_WARNED = [False]
_FRAMES_AT_LAST_CHECK = [-1]  # Dynamo's frame count when check_recompile_budget last looked
#: Warn when this fraction of the recompile limit is used up.
_WARN_FRACTION = 0.75


def recompile_count() -> int:
    """Graphs Dynamo has compiled in this process for user code (turbotrain's own fused-op
    epilogues, which compile once per dtype, are not counted)."""
    from torch._dynamo.utils import counters

    return max(0, counters["stats"]["unique_graphs"] - epilogue_frames())


def recompile_limit() -> int:
    """Dynamo's per-function graph limit (``recompile_limit``, ``cache_size_limit`` before torch 2.6)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or config.cache_size_limit)


def most_compiled_function() -> tuple[int, str] | None:
    """The function Dynamo holds the most graphs for, as (graphs, "name (file:line)"), or None.

    The recompile limit applies per function (per code object, each with its own cache of graphs);
    a model with graph breaks has several such functions of one graph each, which is no cause for
    alarm. None where this torch does not expose the per-code caches (private APIs, read defensively).
    """
    try:
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    best = None
    for ref in list(getattr(input_codes, "seen", ())):
        code = ref() if callable(ref) else None
        if code is None:
            continue
        graphs = len(_debug_get_cache_entry_list(code))
        if best is None or graphs > best[0]:
            best = (graphs, f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})")
    return best


def check_recompile_budget(count: int | None = None) -> bool:
    """Warn once when a compiled function's graphs approach the recompile limit; True when it warned now.

    The limit is per function: the count is the most graphs any one function holds, named in the
    warning. Where torch does not expose that, the process's graph count stands in, which errs on the
    early side for a model with graph breaks.
    """
    if _WARNED[0]:
        return False
    where = ""
    if count is None:
        # Called every step: the per-code caches only change when Dynamo converts a frame, so the
        # walk over every code it has seen runs only after one did.
        from torch._dynamo.utils import counters

        frames = counters["frames"]["total"]
        if frames == _FRAMES_AT_LAST_CHECK[0]:
            return False
        _FRAMES_AT_LAST_CHECK[0] = frames
        most = most_compiled_function()
        count, where = most if most is not None else (recompile_count(), "")
    limit = recompile_limit()
    if count < _WARN_FRACTION * limit:
        return False
    _WARNED[0] = True
    subject = f"{count} graphs compiled for {where}" if where else f"{count} graphs compiled so far"
    warnings.warn(
        f"{subject}, and torch.compile stops recompiling a function after "
        f"{limit} (torch._dynamo.config.recompile_limit) and then runs it uncompiled. Varying "
        "sequence lengths are the usual cause: set Config(seq_buckets=(...)) so batches are padded "
        "to a few lengths, or compile with dynamic=True.",
        stacklevel=2,
    )
    return True


#: Dynamo setting (torch 2.13 has it; a torch without it keeps the graph breaks) that lets a checkpointed
#: region with a Python side effect trace as one graph, the side effect run once in forward and not
#: again when backward recomputes the region.
_ONCE = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def _side_effects_once():
    """Trace checkpointed blocks whole even when their forward mutates Python state.

    Hugging Face models do (transformers' output collector, a ``CompileableContextVar``, is mutated
    inside each decoder layer as Dynamo sees it). With Dynamo's default every checkpointed layer
    broke the graph (8 breaks in HF Llama's first steps) and ran and recomputed eagerly: at T=1024
    selective checkpointing kept 0.84x of torch-compile-step's tensor peak at 1.00x its speed, and
    0.80x at 1.09x once whole (benchmarks/2026-12-06-avx2-selective-checkpoint.md). Running such a
    side effect once is also what the model means: eager checkpointing replays it in backward (a
    hook that appends, appends twice).
    """
    return torch._dynamo.config.patch(**{_ONCE: True})


#: Reductions whose repeats fold_repeated_reductions() folds (the ones a backward repeats: bias gradients).
_REDUCTIONS = (("sum", "dim_IntList"), ("sum", "default"), ("mean", "dim"), ("amax", "default"), ("amin", "default"))


def fold_repeated_reductions(graph) -> int:
    """Make each repeat of a bf16/fp16 reduction in ``graph`` (an FX graph) a copy of its first instance.

    Works around an Inductor C++ bug (torch 2.13, CPU): when two identical reductions with a bf16 or
    fp16 result land in one kernel, the kernel computes the reduction once and declares the same
    converted variable for each of its stores, which does not compile ("conflicting declaration
    at_BFloat16_tmp_acc0_vec"). A backward repeats a reduction whenever two biases add to the same
    sum: a parallel-residual block (GPT-NeoX, Phi: ``x + attn(x) + mlp(x)``) gives its attention's
    and its MLP's output biases the same gradient, the column sum of the residual's. With bf16
    parameters (``bf16-master``) those sums are bf16, so ``compile=True`` failed on GPT-NeoX where
    torch.compile over an autocast step (FP32 parameters, FP32 sums) did not. The copy is the same
    value in a buffer of its own (the two gradients do not alias). Returns the number folded.
    """
    aten = torch.ops.aten
    targets = {getattr(getattr(aten, op), overload) for op, overload in _REDUCTIONS}
    first, folded = {}, 0
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if (node.op != "call_function" or node.target not in targets or not isinstance(value, torch.Tensor)
                or value.dtype not in (torch.bfloat16, torch.float16)):
            continue
        key = (node.target, repr(node.args), repr(sorted(node.kwargs.items())))
        if key not in first:
            first[key] = node
            continue
        with graph.inserting_after(node):
            copy = graph.call_function(aten.clone.default, (first[key],))
        copy.meta.update(node.meta)
        node.replace_all_uses_with(copy)
        graph.erase_node(node)
        folded += 1
    return folded


@functools.cache
def _fold_pass():
    """fold_repeated_reductions as an Inductor post-grad pass (built on first use: importing
    torch._inductor takes seconds)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class FoldRepeatedReductions(CustomGraphPass):
        def __call__(self, graph) -> None:
            fold_repeated_reductions(graph)

        def uuid(self):  # Inductor's FX graph cache keys compiled graphs on it
            return get_hash_for_files((__file__,))

    return FoldRepeatedReductions()


def keep_fp32_in_graph(graph) -> int:
    """Give the FP32 keep-list's ops that still take bf16/fp16 tensors in a Dynamo graph FP32 inputs
    (and, for the norms and softmaxes, their output back in the input's dtype), as
    :class:`~turbotrain.precision.keep_fp32.KeepFp32Mode` does in eager code; returns how many.

    Dynamo hands the mode most calls while it traces, and the graph then holds the mode's casts. It
    does not hand it the call of a torch.nn module constructed inside the compiled code: Hugging
    Face's BART, T5 and classification heads build ``CrossEntropyLoss()`` in their forward, and the
    loss came out of Inductor in bf16 (BART's step losses up to 2e-3 off the FP32 loop's, every
    other model's ~5e-5). An op the mode did handle already takes FP32 inputs and is left alone.
    """
    from torch import fx

    from ..precision.keep_fp32 import RETURN_FP32, RETURN_INPUT_DTYPE

    # Tensor methods (x.softmax(-1)) are call_method nodes named by the method
    methods = {f.__name__: f for f in RETURN_INPUT_DTYPE | RETURN_FP32 if getattr(torch.Tensor, f.__name__, None) is f}
    low = (torch.bfloat16, torch.float16)

    def low_dtype(arg):
        value = arg.meta.get("example_value") if isinstance(arg, fx.Node) else None
        return value.dtype if isinstance(value, torch.Tensor) and value.dtype in low else None

    changed = 0
    for node in list(graph.nodes):
        target = node.target if node.op == "call_function" else methods.get(node.target) if node.op == "call_method" else None
        if target not in RETURN_FP32 and target not in RETURN_INPUT_DTYPE:
            continue
        inputs = [a for a in node.all_input_nodes if low_dtype(a) is not None]
        if not inputs:
            continue
        back = low_dtype(inputs[0])
        casts = {}
        with graph.inserting_before(node):
            for a in inputs:
                casts[a] = graph.call_method("float", (a,))
                value = a.meta["example_value"]
                with value.fake_mode:
                    casts[a].meta["example_value"] = value.float()
        node.args = fx.map_arg(node.args, lambda a: casts.get(a, a))
        node.kwargs = fx.map_arg(node.kwargs, lambda a: casts.get(a, a))
        out = node.meta.get("example_value")
        if isinstance(out, torch.Tensor):
            with out.fake_mode:
                node.meta["example_value"] = out.float()
        if target in RETURN_INPUT_DTYPE:
            with graph.inserting_after(node):
                cast_back = graph.call_method("to", (node, back))
            if isinstance(out, torch.Tensor):
                with out.fake_mode:
                    cast_back.meta["example_value"] = out.to(back)
            node.replace_all_uses_with(cast_back, delete_user_cb=lambda user: user is not cast_back)
        changed += 1
    return changed


@functools.cache
def _keep_fp32_pass():
    """keep_fp32_in_graph as an Inductor pre-grad pass (on the Dynamo graph, before autograd)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from ..precision import keep_fp32

    class KeepFp32InGraph(CustomGraphPass):
        def __call__(self, graph) -> None:
            keep_fp32_in_graph(graph)

        def uuid(self):  # the keep-list's sets decide what it casts: a change to them is a new pass
            return get_hash_for_files((__file__, keep_fp32.__file__))

    return KeepFp32InGraph()


def _compile_options(low_precision: bool = False) -> dict:
    """Inductor options for the Engine's compile: the fold pass, then any the user set; in a bf16/fp16
    run the keep-list pass before them (:func:`keep_fp32_in_graph`)."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    options = {"post_grad_custom_post_pass": (_fold_pass(), *get_custom_graph_passes(config.post_grad_custom_post_pass))}
    if low_precision:
        options["pre_grad_custom_pass"] = (_keep_fp32_pass(), *get_custom_graph_passes(config.pre_grad_custom_pass))
    return options


def _is_hf_model(model) -> bool:
    """A transformers PreTrainedModel (without importing transformers where it is not loaded)."""
    import sys

    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


@contextlib.contextmanager
def unpadded_hf_masks(kwargs: dict):
    """While a Hugging Face model runs on ``kwargs``: if their ``attention_mask`` (and any other
    ``*attention_mask``, such as an encoder-decoder's ``decoder_attention_mask``) masks nothing (a
    host-side check, once a step, as transformers' own eager check), its plain causal sdpa mask is
    left to ``scaled_dot_product_attention(is_causal=True)`` instead of being materialised.

    Under torch.compile transformers (5.x with torch < 2.14) cannot read the mask's values while
    tracing, so it builds the full 4-d causal mask from a tokenizer's all-ones mask, and attention
    runs the whole T x T square: the stock kernel without its causal path, and turbotrain's plain
    attention on its masked path, FP32 scores of all of it kept for the backward. Leaving the mask
    out does not help in training: with no cache, transformers then looks for packed sequences in
    the position ids, which it cannot decide while tracing either. So the mask stays, and the sdpa
    mask function returns None when what it was asked for is exactly causal (no packing, no extra
    mask functions, no offsets, no window shorter than the sequence), which is what eager
    transformers does for such a batch. A padded batch, or any other mask, is built as transformers
    builds it, and so is every mask built outside Dynamo's tracing (another thread's model running
    eagerly while the registry entry is swapped gets its own mask).
    """
    # every padding mask the model may build from (an encoder-decoder's decoder_attention_mask too)
    masks = [value for name, value in kwargs.items() if name.endswith("attention_mask") and value is not None]
    if not isinstance(kwargs.get("attention_mask"), torch.Tensor) or not all(
            isinstance(m, torch.Tensor) and m.dim() == 2 and bool(m.all()) for m in masks):
        yield
        return
    from transformers import masking_utils

    registry = masking_utils.AttentionMaskInterface._global_mapping
    stock = registry["sdpa"]
    registry["sdpa"] = _causal_skipping(stock)
    try:
        yield
    finally:
        registry["sdpa"] = stock


def _is_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0  # a static cache's tensor offset is not read


@functools.cache  # one function per stock one: the compiled graph's guard on it holds from step to step
def _causal_skipping(stock):
    """``stock`` (transformers' sdpa mask function), but None where the request is exactly causal.

    The rule is the one eager transformers applies to an unpadded batch (masking_utils'
    ``_ignore_causal_mask_sdpa``): the caller allows the skip (it does not when it adds mask
    functions, packing or a bidirectional pattern), queries and keys are the same positions (no
    offsets, as many queries as keys), and a sliding window or chunk (``local_size``) is longer than
    the keys, so it masks nothing beyond the causal triangle (Mistral by default, any model
    configured with a window at a sequence shorter than it).
    """

    def sdpa_mask(*args, **kw):
        if not torch.compiler.is_compiling():
            # Eagerly transformers reads the mask itself. This also keeps another thread's model,
            # which sees the registry swapped while the Engine's compiled call runs, on its own mask.
            return stock(*args, **kw)
        window, keys = kw.get("local_size"), kw.get("kv_length")
        exact_causal = (not args and kw.get("allow_is_causal_skip", True) and isinstance(keys, int)
                        and kw.get("q_length") == keys and (window is None or keys < window)
                        and _is_zero(kw.get("q_offset", 0)) and _is_zero(kw.get("kv_offset", 0)))
        return None if exact_causal else stock(*args, **kw)

    return sdpa_mask


#: The runner's code object copies, one per kind of Engine (see _own_code), while an Engine uses it.
_CODE_COPIES: "weakref.WeakValueDictionary[tuple, types.CodeType]" = weakref.WeakValueDictionary()


def _model_signature(model: torch.nn.Module) -> tuple:
    """What two Engines must share for one's graphs to serve the other: module types, and parameter and
    buffer shapes, dtypes and trainability, in order."""
    return (tuple((n, type(m).__qualname__) for n, m in model.named_modules()),
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in model.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in model.named_buffers()))


def _own_code(fn, kind: tuple):
    """``fn`` (a function or a bound method) on a copy of its code object shared only by Engines of one
    ``kind``.

    Dynamo keeps its graphs, and counts them against ``recompile_limit``, per code object. Every
    Engine's runner is the same function, so a process that built Engines for nine models of different
    shapes had spent the limit on the first eight, and the ninth ran eagerly under compile=True with
    no more than a log line. A copy per kind of Engine (the model's structure, the run's dtype and
    attention path) gives each its own limit, while an Engine rebuilt on the same model (a notebook
    cell run again, a test) still finds the graphs compiled for the first.
    """
    if isinstance(fn, types.MethodType):
        return types.MethodType(_own_code(fn.__func__, kind), fn.__self__)
    key = (fn.__code__, kind)
    code = _CODE_COPIES.get(key)
    if code is None:
        code = _CODE_COPIES[key] = fn.__code__.replace()
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return copy


class CompileTransform(Transform):
    """``Config(compile=True)``: torch.compile over the forward *and* the loss, as one function.

    The loss (the fused linear+cross-entropy head included) sits in the same graph as the forward,
    so Inductor fuses across the model/loss boundary the way torch.compile over a whole training
    step does. Backward runs from that graph's compiled backward.

    ``attention=True`` runs the model's ``scaled_dot_product_attention`` calls inside that graph
    as plain PyTorch attention that Inductor fuses, in place of the stock kernel
    (fusion/attention.py); None chooses it on a CPU in bf16, where the stock op is the CPU flash
    kernel (``Config(attention='auto')``, the Engine's default). Measured there on a quiet 2-core
    AVX512-BF16 EPYC at T=256 (benchmarks/2026-12-04-avx512-plain-attention.md): the whole step
    1.13x, 1.15x and 1.09x torch.compile over the step on gpt, user-gpt and hf-llama, where the
    same row with the stock kernel was 1.00-1.04x; it keeps FP32 scores for the backward, so it
    costs memory (peak +15-20% there, more at long T).
    """

    name = "compile"

    def __init__(self, attention: bool | None = False):
        self._graphs_at_start: int | None = None
        self._hf = False  # a Hugging Face model: unpadded batches keep sdpa's causal path (set in apply)
        self.attention = attention
        """True, False, or None: chosen at set-up (plain attention on a CPU in bf16)."""
        self._attention_reason = ""
        self._mode = None  # the PlainAttentionMode the compiled runner enters, when attention is on
        self._model: torch.nn.Module | None = None

    def apply(self, model, plan, ctx) -> None:
        self._hf = _is_hf_model(model)
        self._model = model  # its structure, once every transform has changed it, picks the runner's code

    def wrap_runner(self, runner, plan, ctx):
        if self.attention is None:
            self.attention = ctx.device.type == "cpu" and ctx.dtype == torch.bfloat16
            self._attention_reason = " (chosen: a CPU in bf16)" if self.attention else ""
        if self.attention:
            from .attention import PlainAttentionMode

            inner, mode = runner, PlainAttentionMode().keep_own_notes()
            self._mode = mode

            def runner(*args, **kwargs):
                with mode:
                    return inner(*args, **kwargs)

        kind = (_model_signature(self._model), ctx.dtype, self.attention)
        compiled = torch.compile(_own_code(runner, kind),
                                 options=_compile_options(ctx.dtype in (torch.bfloat16, torch.float16)))
        once = hasattr(torch._dynamo.config, _ONCE)
        if not once and not self._hf:
            return compiled

        def run_compiled(args, kwargs, *rest):
            with contextlib.ExitStack() as stack:
                if self._hf:
                    stack.enter_context(unpadded_hf_masks(kwargs))
                if once:
                    stack.enter_context(_side_effects_once())
                return compiled(args, kwargs, *rest)

        return run_compiled

    def describe(self) -> str:
        if self.attention is None:  # auto, decided when the first step knows the device and dtype
            attention = ("scaled_dot_product_attention chosen at the first step (compiled plain attention "
                         "on a CPU in bf16, else the stock kernel)")
        elif self.attention:
            attention = "scaled_dot_product_attention as compiled plain attention" + self._attention_reason
        else:
            attention = "stock scaled_dot_product_attention"
        if self._mode is not None and self._mode.left_to_stock:
            attention += "; calls left to the stock kernel: " + "; ".join(sorted(self._mode.left_to_stock))
        return f"compile: forward and loss as one graph; {attention}"

    def recompiles(self) -> int:
        """Graphs built after the first step: 0 while shapes (and buckets) are stable."""
        if self._graphs_at_start is None:  # the first step's compile is not a recompile
            self._graphs_at_start = recompile_count()
        count = recompile_count() - self._graphs_at_start
        check_recompile_budget()
        return count
