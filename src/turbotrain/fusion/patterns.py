"""Finding fusable sites in an arbitrary nn.Module, and how to build each site's fused form.

With an example the model was probed on (probe.py), sites are found from data flow, whatever the
modules are called: three Linears of one module that read the same tensor in one call (qkv); a
Linear or LayerNorm whose output is the input of an activation module of the same parent
(linear_act, layernorm_gelu); two same-shape Linears reading a module's input, SiLU on one of them
and a third Linear after (swiglu; the SiLU a module, or a function the forward calls, which is
seen in the values the third Linear read). Without an example the name tables below are the fallback.

A Site names a small *unit* of the user's model (an attention module, an MLP, the parent of a
Linear+activation pair), a ``build`` that turns such a unit into its fused form (used first on a
copy, to verify, then on the real unit), an ``install`` that puts the result in place, and
``sample``/``run`` that say how to exercise the unit: on the inputs it received in the probe, or
on inputs made from its shapes.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from .modules import FusedLayerNormAct, FusedLinearAct, FusedQKVProjection, FusedSwiGLUMLP, QKVSlice
from .ops._activations import ACTIVATIONS, activation_of_module, activation_reference
from .probe import Call, Trace

__all__ = ["Site", "find_sites", "activation_name", "QKV_NAMES", "MLP_NAMES", "SWIGLU_NAMES"]

#: Fallback (no example): attention projection names, Llama/Mistral/GPT-NeoX style and HF-BERT style.
QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
#: Fallback: fc -> act -> proj MLPs (the nanoGPT names are c_fc / gelu / c_proj).
MLP_NAMES = (("fc", "act", "proj"), ("c_fc", "gelu", "c_proj"), ("c_fc", "act", "c_proj"))
#: The fallback's SwiGLU names (Llama's); found by data flow, any names work.
SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")
_SAMPLE_ROWS = (2, 5)  # batch, sequence of the verification sample: small, and not a power of two
# Where an unknown activation module is compared with the fused ones: both signs, and past +-10 so
# that a clipped GELU (transformers' gelu_10) is not taken for the plain one.
_ACT_PROBE = torch.linspace(-12.0, 12.0, 97, dtype=torch.float64).view(1, -1)


@dataclass
class Site:
    path: str
    """Qualified name of the site's module: the Linear/LayerNorm of a pair, the module holding
    q/k/v, the MLP. ``fuse(filter_fn=...)`` is asked about the module at this path."""
    pattern: str
    unit: nn.Module
    build: Callable[[nn.Module], tuple[nn.Module, dict]]
    install: Callable[[nn.Module], None]
    sample: Callable[[torch.dtype, torch.device], tuple[tuple, dict]]
    """(args, kwargs) to run the unit on, in the given dtype and device."""
    run: Callable = field(default=lambda unit, *args, **kwargs: unit(*args, **kwargs))
    problem: Optional[str] = None
    """Set when the site was found but cannot be fused; it is then reported, never built."""


# --- recognising modules ---------------------------------------------------------------------

def _is_linear(m) -> bool:
    return type(m) is nn.Linear  # exactly: subclasses (quantised, LoRA) may compute something else


def _stateless_leaf(m) -> bool:
    return not m._modules and not m._parameters and not m._buffers


def _computes(module: nn.Module) -> Optional[str]:
    """The fused activation ``module`` computes in both train and eval mode, judged on _ACT_PROBE."""
    found, was_training = set(), module.training
    try:
        for training in (True, False):
            module.training = training
            # A Dropout draws random numbers, a Softmax warns about its dim: leave no trace of either.
            with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = module.forward(_ACT_PROBE.clone())  # forward: no user hook sees the probe
            if not isinstance(out, torch.Tensor) or out.shape != _ACT_PROBE.shape:
                return None
            found.add(next((a for a in ACTIVATIONS if torch.allclose(
                out.double(), activation_reference(_ACT_PROBE, a), rtol=1e-6, atol=1e-9)), None))
    except Exception:  # not an elementwise function of one tensor
        return None
    finally:
        module.training = was_training
    return found.pop() if len(found) == 1 else None


def activation_name(module, _cache: Optional[dict] = None) -> Optional[str]:
    """The fused-op name of an activation module, or None.

    torch's ReLU/GELU/SiLU by type; any other module without parameters, buffers or children
    (transformers' GELUActivation, NewGELUActivation, GELUTanh, SiLUActivation, ...) by what it
    computes, so that transformers need not be imported to recognise its classes.

    >>> activation_name(nn.GELU(approximate="tanh")), activation_name(nn.Dropout(0.1))
    ('gelu_tanh', None)
    """
    if not isinstance(module, nn.Module):
        return None
    name = activation_of_module(module)
    if name is not None or not _stateless_leaf(module):
        return name
    if _cache is None:
        return _computes(module)
    if id(module) not in _cache:
        _cache[id(module)] = _computes(module)
    return _cache[id(module)]


def _pair_kind(first, second, patterns, acts: Optional[dict] = None) -> Optional[tuple[str, str]]:
    """(pattern, activation) when ``second`` after ``first`` is a fusable pair, else None."""
    act = activation_name(second, acts)
    if act is None:
        return None
    if _is_linear(first) and "linear_act" in patterns:
        return "linear_act", act
    if (type(first) is nn.LayerNorm and "layernorm_gelu" in patterns and act.startswith("gelu")
            and len(first.normalized_shape) == 1):
        return "layernorm_gelu", act
    return None


# --- samples -----------------------------------------------------------------------------------

def _random_sample(features: int, count: int = 1):
    def sample(dtype, device):
        g = torch.Generator().manual_seed(1)
        return tuple(torch.randn(*_SAMPLE_ROWS, features, generator=g).to(device, dtype).requires_grad_()
                     for _ in range(count)), {}
    return sample


def _recorded_sample(args: tuple, kwargs: dict):
    """The inputs a unit received in the probe, floating tensors cast to the verification dtype."""
    def sample(dtype, device):
        def cast(t):
            if not isinstance(t, torch.Tensor):
                return t
            if not t.is_floating_point():
                return t.to(device)
            return t.detach().to(device, dtype).requires_grad_(t.requires_grad)

        return pytree.tree_map(cast, (args, kwargs))
    return sample


def _qkv_recorded_sample(x: torch.Tensor):
    # The input q/k/v read in the probe, and another of its shape for the cross-attention check.
    other = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    return _recorded_sample((x.detach().clone().requires_grad_(), other.requires_grad_()), {})


# --- problems shared by both finders -------------------------------------------------------------

def _join(*parts) -> str:
    return ".".join(p for p in parts if p)


def _get(root: nn.Module, name: str) -> nn.Module:
    return root.get_submodule(name)


def _put(root: nn.Module, name: str, new: nn.Module) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(root.get_submodule(owner), attr, new)


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


def _mixed_trainable(*linears) -> Optional[str]:
    """Concatenated weights are one Parameter with one requires_grad: the site must agree on it."""
    for kind in ("weight", "bias"):
        flags = {getattr(m, kind).requires_grad for m in linears if getattr(m, kind) is not None}
        if len(flags) > 1:
            return (f"some of its {kind}s are frozen (requires_grad=False) and some are not; one concatenated "
                    "Parameter would train the frozen ones or freeze the others")
    return None


def _setter(owner: nn.Module, name: str):
    return lambda new: setattr(owner, name, new)


# --- building each pattern (the same build whichever finder found the site) ---------------------

def _pair_site(path, unit, first: str, second: str, kind: tuple[str, str], sample, install, problem) -> Site:
    """``unit.<first>`` becomes the fused pair and ``unit.<second>`` an Identity, in place."""
    pattern, act = kind
    fused_cls = FusedLinearAct if pattern == "linear_act" else FusedLayerNormAct

    def build(u):
        _put(u, first, fused_cls(_get(u, first), act))
        _put(u, second, nn.Identity())
        return u, {}

    return Site(path, pattern, unit, build, install, sample, problem=problem)


def _qkv_site(path, module, names, counts, sample) -> Site:
    """The three Linears ``names`` of ``module`` become slices of one FusedQKVProjection."""
    linears = [_get(module, n) for n in names]
    problem = (
        "q/k/v have different in_features, so they cannot be fed by one input"
        if len({m.in_features for m in linears}) > 1 else
        "some of q/k/v have a bias and some do not" if len({m.bias is None for m in linears}) > 1 else
        "q/k/v differ in dtype or device" if len({(m.weight.dtype, m.weight.device) for m in linears}) > 1 else
        "an attribute named 'qkv_fused' already exists" if hasattr(module, "qkv_fused") else
        _tied(counts, *linears) or _mixed_trainable(*linears) or _hooked(*linears)
    )

    def build(unit):
        olds = [_get(unit, n) for n in names]
        shared = FusedQKVProjection(olds)
        unit.add_module("qkv_fused", shared)
        pmap = {}
        for i, (n, old) in enumerate(zip(names, olds)):
            _put(unit, n, QKVSlice(shared, i))
            pmap[old.weight] = (shared.weight, shared.offsets(i))
            if old.bias is not None:
                pmap[old.bias] = (shared.bias, shared.offsets(i))
        return unit, pmap

    def run(unit, x, other):
        # All three on one input (the fused GEMM), then k alone on another input (cross attention).
        outs = [_get(unit, n)(x) for n in names] + [_get(unit, names[1])(other)]
        return torch.cat([o.reshape(-1) for o in outs])

    # build() edits the unit in place, so installing the real one is a no-op.
    return Site(path, "qkv", module, build, lambda new: None, sample, run=run, problem=problem)


def _swiglu_problem(module, owner, gate, up, down, acts, counts) -> Optional[str]:
    extra = [n for n, m in module._modules.items() if all(m is not k for k in (gate, up, down, *acts))]
    return (
        "the model itself is the MLP; fuse its parent, or wrap it" if owner is None else
        f"it has other children ({', '.join(sorted(extra))}) the fused MLP would drop" if extra else
        "it has parameters of its own the fused MLP would drop" if list(module._parameters) else
        "gate and up differ in shape or bias" if gate.weight.shape != up.weight.shape
        or (gate.bias is None) != (up.bias is None) else
        _tied(counts, gate, up) or _mixed_trainable(gate, up) or _hooked(gate, up, down, *acts)
    )


def _swiglu_site(path, module, owner, names, sample, problem) -> Site:
    """The MLP ``module`` is replaced in its owner by FusedSwiGLUMLP(gate, up, down)."""
    def build(unit):
        g, u, d = (_get(unit, n) for n in names)
        fused = FusedSwiGLUMLP(g, u, d, names=tuple(names))
        h = fused.hidden
        pmap = {g.weight: (fused.gate_up_weight, slice(0, h)), u.weight: (fused.gate_up_weight, slice(h, 2 * h))}
        if g.bias is not None:
            pmap.update({g.bias: (fused.gate_up_bias, slice(0, h)), u.bias: (fused.gate_up_bias, slice(h, 2 * h))})
        return fused, pmap

    install = _setter(*owner) if owner is not None else (lambda new: None)
    return Site(path, "swiglu", module, build, install, sample, problem=problem)


# --- the fallback: sites by name ---------------------------------------------------------------

def _sequential_sites(path, seq: nn.Sequential, patterns, claimed) -> list[Site]:
    sites = []
    names = list(seq._modules)
    for a, b in zip(names, names[1:]):
        first, second = seq._modules[a], seq._modules[b]
        kind = _pair_kind(first, second, patterns) if id(first) not in claimed else None
        if kind is None:
            continue
        claimed.update((id(first), id(second)))
        features = first.in_features if kind[0] == "linear_act" else first.normalized_shape[0]

        def install(new, a=a, b=b):
            setattr(seq, a, new[0])
            setattr(seq, b, new[1])

        sites.append(_pair_site(_join(path, a), nn.Sequential(first, second), "0", "1", kind,
                                _random_sample(features), install, _hooked(first, second)))
    return sites


def _named_mlp_site(path, module, patterns, claimed) -> Optional[Site]:
    for fc_name, act_name, proj_name in MLP_NAMES:
        fc, act_mod = getattr(module, fc_name, None), getattr(module, act_name, None)
        kind = _pair_kind(fc, act_mod, ("linear_act",)) if _is_linear(fc) else None
        if kind is not None and isinstance(getattr(module, proj_name, None), nn.Module) and id(fc) not in claimed:
            claimed.update((id(fc), id(act_mod)))
            return _pair_site(_join(path, fc_name), module, fc_name, act_name, kind, _random_sample(fc.in_features),
                              lambda new: None, _hooked(fc, act_mod))
    return None


def _named_swiglu_site(path, module, owner, counts, claimed) -> Optional[Site]:
    linears = [getattr(module, n, None) for n in SWIGLU_NAMES]
    if not all(_is_linear(m) for m in linears) or any(id(m) in claimed for m in linears):
        return None
    claimed.update(id(m) for m in linears)
    acts = [m for n, m in module._modules.items() if n in ("act_fn", "act")]
    problem = _swiglu_problem(module, owner, *linears, acts, counts)
    return _swiglu_site(path, module, owner, SWIGLU_NAMES, _random_sample(linears[0].in_features), problem)


def _named_qkv_site(path, module, counts, claimed) -> Optional[Site]:
    for names in QKV_NAMES:
        linears = [getattr(module, n, None) for n in names]
        if all(_is_linear(m) for m in linears) and not any(id(m) in claimed for m in linears):
            claimed.update(id(m) for m in linears)
            return _qkv_site(path, module, names, counts, _random_sample(linears[0].in_features, count=2))
    return None


def _sites_by_name(model, patterns, counts, owners) -> list[Site]:
    claimed: set[int] = set()
    sites: list[Site] = []
    for path, module in model.named_modules():
        found = [
            _named_qkv_site(path, module, counts, claimed) if "qkv" in patterns else None,
            _named_swiglu_site(path, module, owners.get(id(module)), counts, claimed) if "swiglu" in patterns else None,
            _named_mlp_site(path, module, patterns, claimed) if "linear_act" in patterns else None,
        ]
        if isinstance(module, nn.Sequential):
            found.extend(_sequential_sites(path, module, patterns, claimed))
        sites.extend(s for s in found if s is not None)
    return sites


# --- sites from data flow ----------------------------------------------------------------------

class _Scope:
    """A module seen running in the probe, and the calls its forward made to its own submodules."""

    def __init__(self, path: str, module: nn.Module, trace: Trace):
        self.path, self.module, self.trace = path, module, trace
        self.calls = trace.calls_of(module)
        self.names = {id(m): n for n, m in module.named_modules() if n}

    def kids(self, call: Call) -> list[Call]:
        """Calls made directly by ``call`` to submodules of this module (not through others)."""
        return [c for c in call.children if id(c.module) in self.names]

    def name(self, module: nn.Module) -> str:
        return self.names[id(module)]

    def recorded(self):
        return _recorded_sample(*self.calls[0].saved)


def _once_each(kids: list[Call], *modules) -> Optional[list[Call]]:
    """The one call of each module among ``kids``, or None if one is called not exactly once."""
    found = [[c for c in kids if c.module is m] for m in modules]
    return [f[0] for f in found] if all(len(f) == 1 for f in found) else None


def _linears_by_input(kids: list[Call]) -> list[tuple[torch.Tensor, list[nn.Module]]]:
    """Linear calls grouped by the tensor object they read, in order of first use."""
    groups: dict[int, tuple[torch.Tensor, list[nn.Module]]] = {}
    for c in kids:
        x = c.tensor_input()
        if _is_linear(c.module) and x is not None:
            mods = groups.setdefault(id(x), (x, []))[1]
            if all(m is not c.module for m in mods):
                mods.append(c.module)
    return list(groups.values())


def _flow_qkv(scope: _Scope, counts, claimed) -> list[Site]:
    triples = [(x, g) for x, g in _linears_by_input(scope.kids(scope.calls[0]))
               if len(g) == 3 and not any(id(m) in claimed for m in g)]
    sites = []
    for i, (x, linears) in enumerate(triples):
        claimed.update(id(m) for m in linears)
        site = _qkv_site(scope.path, scope.module, [scope.name(m) for m in linears], counts, _qkv_recorded_sample(x))
        if i:
            site.problem = "a second q/k/v triple in the same module; one fused projection per module"
        sites.append(site)
    return sites


def _is_swiglu_of(gate_out, up_out, down_in) -> bool:
    """Whether ``down_in`` holds silu(gate_out) * up_out, to the rounding of the probe's dtype: how an
    MLP that calls its activation as a function (``w2(F.silu(w1(x)) * w3(x))``) is recognised."""
    tensors = (gate_out, up_out, down_in)
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors) \
            or not gate_out.shape == up_out.shape == down_in.shape:
        return False
    tol = 1e-4 if down_in.dtype in (torch.float32, torch.float64) else 2e-2
    with torch.no_grad():
        want = F.silu(gate_out.float()) * up_out.float()
        return torch.allclose(down_in.float(), want, rtol=tol, atol=tol * float(want.abs().max().clamp_min(1e-6)))


def _functional_swiglu(kids: list[Call], pair: list[nn.Module], out: dict) -> Optional[tuple]:
    """(gate, up, down) when a Linear other than ``pair`` reads silu(one of pair) * (the other);
    ``out``: each kid module's first output, by id."""
    for gate, up in (pair, pair[::-1]):
        for c in kids:
            if (_is_linear(c.module) and all(c.module is not m for m in pair)
                    and _is_swiglu_of(out[id(gate)], out[id(up)], c.tensor_input())):
                return gate, up, c.module
    return None


def _swiglu_flow_problem(scope: _Scope, gate, up, down, act) -> Optional[str]:
    """Why the MLP's calls are not all exactly down(act(gate(x)) * up(x)) as far as data flow shows
    (the product itself is checked by verification). ``act`` None: the activation is a function
    call, so the SiLU-and-product is checked on each call's tensors instead."""
    for call in scope.calls:
        x = call.tensor_input()
        if x is None:
            return "it is called with more than one argument or by keyword; the fused MLP takes one tensor"
        found = _once_each(scope.kids(call), gate, up, down, *([act] if act is not None else []))
        if found is None:
            return "its Linears and activation are not each called once per call"
        g, u, d = found[:3]
        if g.tensor_input() is not x or u.tensor_input() is not x:
            return "gate and up do not read its input (something runs before them inside it)"
        if act is not None and found[3].tensor_input() is not g.output:
            return "the activation is not applied to the gate's output in every call"
        if act is None and not _is_swiglu_of(g.output, u.output, d.tensor_input()):
            return f"{scope.name(down)} does not read silu({scope.name(gate)}) * {scope.name(up)} in every call"
        if call.output is not d.output:
            return (f"it returns something other than {scope.name(down)}'s output (a residual, dropout or "
                    "norm after it?), which the fused MLP would drop")
    return None


def _flow_swiglu(scope: _Scope, owner, counts, claimed, acts: dict) -> list[Site]:
    kids = scope.kids(scope.calls[0])
    output_of = {}
    for c in kids:
        output_of.setdefault(id(c.module), c.output)
    for _, pair in _linears_by_input(kids):
        if len(pair) != 2 or pair[0].weight.shape != pair[1].weight.shape or any(id(m) in claimed for m in pair):
            continue
        act_call = next((c for c in kids if c.tensor_input() is not None and activation_name(c.module, acts) == "silu"
                         and any(c.tensor_input() is output_of[id(m)] for m in pair)), None)
        act = act_call.module if act_call is not None else None
        if act is not None:
            gate, up = pair if act_call.tensor_input() is output_of[id(pair[0])] else pair[::-1]
            downs = [c.module for c in kids if _is_linear(c.module) and c.module is not gate and c.module is not up]
            if not downs:
                continue
            down = downs[-1]
        else:  # F.silu in the forward: no module to see, so the values say which Linear is which
            found = _functional_swiglu(kids, pair, output_of)
            if found is None:
                continue
            gate, up, down = found
        acts_used = [act] if act is not None else []
        claimed.update(id(m) for m in (gate, up, down, *acts_used))
        names = tuple(scope.name(m) for m in (gate, up, down))
        problem = (_swiglu_problem(scope.module, owner, gate, up, down, acts_used, counts)
                   or _swiglu_flow_problem(scope, gate, up, down, act))
        if problem is None and any("." in n for n in names):
            problem = f"its Linears {'/'.join(names)} are not direct children of the MLP"
        return [_swiglu_site(scope.path, scope.module, owner, names, scope.recorded(), problem)]
    return []


def _pair_flow_problem(scope: _Scope, first, second) -> Optional[str]:
    f, s = scope.name(first), scope.name(second)
    for call in scope.calls:
        found = _once_each(scope.kids(call), first, second)
        if found is None or found[1].tensor_input() is not found[0].output:
            return (f"{s} is not applied once, to {f}'s output, in every call of its parent; "
                    "it cannot become an Identity")
    if len(scope.trace.calls_of(first)) != len(scope.calls) or len(scope.trace.calls_of(second)) != len(scope.calls):
        return f"{f} or {s} is also called from outside its parent"
    return None


def _flow_pairs(scope: _Scope, patterns, claimed, acts: dict) -> list[Site]:
    kids = scope.kids(scope.calls[0])
    producer = {id(c.output): c for c in kids if isinstance(c.output, torch.Tensor) and c.tensor_input() is not None}
    sites = []
    for c in kids:
        x = c.tensor_input()
        src = producer.get(id(x)) if x is not None else None
        if src is None or src.output is not x or id(src.module) in claimed or id(c.module) in claimed:
            continue
        kind = _pair_kind(src.module, c.module, patterns, acts)
        if kind is None:
            continue
        claimed.update((id(src.module), id(c.module)))
        problem = _pair_flow_problem(scope, src.module, c.module) or _hooked(src.module, c.module)
        sites.append(_pair_site(_join(scope.path, scope.name(src.module)), scope.module, scope.name(src.module),
                                scope.name(c.module), kind, scope.recorded(), lambda new: None, problem))
    return sites


def _sites_by_flow(model, trace: Trace, patterns, counts, owners) -> list[Site]:
    claimed: set[int] = set()
    acts: dict = {}  # activation_name per module, each judged once
    sites: list[Site] = []
    for path, module in model.named_modules():
        if not module._modules or not trace.calls_of(module):
            continue
        scope = _Scope(path, module, trace)
        if "qkv" in patterns:
            sites.extend(_flow_qkv(scope, counts, claimed))
        if "swiglu" in patterns:
            sites.extend(_flow_swiglu(scope, owners.get(id(module)), counts, claimed, acts))
        if "linear_act" in patterns or "layernorm_gelu" in patterns:
            sites.extend(_flow_pairs(scope, patterns, claimed, acts))
    return sites


def find_sites(model: nn.Module, patterns, trace: Optional[Trace] = None) -> list[Site]:
    """Every fusable site in ``model`` for the named patterns: from the data flow ``trace`` records
    (probe.probe), or from module names when there is none. Parents in module order; within one,
    qkv, then swiglu, then pairs in call order."""
    counts = Counter(p for _, p in model.named_parameters(remove_duplicate=False))
    owners = {id(child): (mod, n) for mod in model.modules() for n, child in mod._modules.items() if child is not None}
    if trace is None:
        return _sites_by_name(model, patterns, counts, owners)
    return _sites_by_flow(model, trace, patterns, counts, owners)
