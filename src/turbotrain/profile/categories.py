"""Which bucket each profiled op's time belongs to (matmul, attention, norm, ... idle/overhead).

Each op's *self* time is counted once, so the buckets cannot double-count nested ops. An op is
put in the bucket of the highest-precedence category found on itself or any ancestor: a copy_
inside a _to_copy is a cast, an add inside layer_norm is norm time, anything under
``Optimizer.step`` is optimizer time. Structural ops (views, allocations) with no categorised
ancestor land in 'other'. Backward nodes map to their forward op (``MmBackward0`` -> mm).
"""

from __future__ import annotations

import re

__all__ = ["CATEGORIES", "category_of_name", "categorise", "IDLE"]

IDLE = "idle/overhead"
#: Every bucket, in report order; the last is the step time no op accounts for.
CATEGORIES = ("matmul", "attention", "norm", "loss", "elementwise", "casts", "optimizer", "comm", "data",
              "other", IDLE)

_OPS = {
    "matmul": {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "scaledmm", "addmv", "mv", "dot", "einsum",
               "convolution", "conv1d", "conv2d", "conv3d", "mkldnnconvolution", "cudnnconvolution",
               "mkldnnlinear", "mkldnnmatmul"},
    "attention": {"scaleddotproductattention", "scaleddotproductflashattention", "scaleddotproductefficientattention",
                  "scaleddotproductcudnnattention", "scaleddotproductflashattentionforcpu", "flashattention",
                  "efficientattention", "softmax", "safesoftmax", "flexattention",
                  "scaleddotproductfusedattentionoverrideable"},
    "norm": {"layernorm", "nativelayernorm", "rmsnorm", "fusedrmsnorm", "batchnorm", "nativebatchnorm",
             "groupnorm", "nativegroupnorm", "instancenorm", "cudnnbatchnorm", "miopenbatchnorm"},
    "loss": {"crossentropyloss", "crossentropy", "logsoftmax", "nllloss", "nllloss2d", "nllnd", "mseloss",
             "binarycrossentropywithlogits", "linearcrossentropy", "fusedlinearcrossentropy"},
    "casts": {"to", "tocopy", "type", "typeas", "convertelementtype", "copyfrom"},
    "elementwise": {"add", "sub", "rsub", "mul", "div", "gelu", "relu", "silu", "tanh", "sigmoid", "exp", "log",
                    "pow", "sqrt", "rsqrt", "neg", "where", "maskedfill", "dropout", "nativedropout", "threshold",
                    "clamp", "clampmin", "clampmax", "abs", "sum", "mean", "copy", "clone", "cat", "stack", "fill",
                    "zero", "zeros", "zeroslike", "ones", "oneslike", "fulllike", "addcmul", "addcdiv", "lerp",
                    "embedding", "embeddingdense", "indexselect", "gather", "scatter", "scatteradd", "indexadd",
                    "max", "min", "amax", "amin", "norm", "linalgvectornorm", "reciprocal", "sign", "square",
                    "erf", "softplus", "bernoulli", "mulscalar", "addscalar", "accumulategrad", "hardtanh",
                    "leakyrelu", "elu", "glu", "cumsum", "sort", "topk", "argmax", "var", "std", "prod", "ne",
                    "eq", "lt", "gt", "le", "ge", "logicaland", "logicalnot", "bitwiseand", "triu", "tril",
                    "arange", "randperm", "uniform", "normal", "randn", "rand", "masked_select", "nonzero",
                    "isfinite", "isinf", "isnan", "any", "all", "maximum", "minimum", "fmod", "remainder"},
}
_LOOKUP = {name: cat for cat, names in _OPS.items() for name in names}
#: Highest first: the region an op sits in beats what the op itself is.
_PRECEDENCE = ("optimizer", "comm", "data", "casts", "loss", "attention", "norm", "matmul", "elementwise")
_COMM_MARKERS = ("nccl", "gloo", "c10d", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                 "reducescatter", "broadcast", "record_param_comms", "turbotrain.comm")
_DATA_MARKERS = ("dataloader", "turbotrain.data")
_BACKWARD_SUFFIX = re.compile(r"(backward(data|input|weight|elemt|reduce)?|_?backward)\d*$")


def _normalise(name: str) -> str:
    name = name.lower()
    name = name.split(": ", 1)[-1]  # "autograd::engine::evaluate_function: MmBackward0"
    name = name.rsplit("::", 1)[-1]  # "aten::mm", "torch::autograd::AccumulateGrad"
    name = name.replace("_", "")
    if name.startswith("foreach"):
        return "foreach"
    return _BACKWARD_SUFFIX.sub("", name) or name


def category_of_name(name: str) -> str | None:
    """The category an op name means on its own, or None for structural/unknown ops."""
    raw = name.lower()
    if raw.startswith("optimizer.") or raw.startswith("optimizer#"):
        return "optimizer"
    if any(m in raw for m in _COMM_MARKERS):
        return "comm"
    if any(m in raw for m in _DATA_MARKERS):
        return "data"
    base = _normalise(name)
    if base == "foreach":
        return "elementwise"
    return _LOOKUP.get(base)


def categorise(event, cache: dict) -> str:
    """Bucket of one profiler FunctionEvent (walks ``cpu_parent``); ``cache`` memoises names."""
    found = set()
    node = event
    while node is not None:
        cat = cache.get(node.name)
        if cat is None and node.name not in cache:
            cat = cache[node.name] = category_of_name(node.name)
        if cat is not None:
            found.add(cat)
        node = node.cpu_parent
    for cat in _PRECEDENCE:
        if cat in found:
            return cat
    return "other"
