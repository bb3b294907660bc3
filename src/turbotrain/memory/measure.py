"""How many bytes of activations a training step keeps alive between forward and backward.

Two measures, for two purposes:

* ``saved_tensor_bytes`` is the plain, obviously-correct count: every tensor autograd saves for
  backward, seen through ``torch.autograd.graph.saved_tensors_hooks``. It cannot see inside a
  non-reentrant checkpoint region (the checkpoint installs its own, inner hooks), so it is the
  reference for models *without* checkpointing.
* ``saved_activation_bytes`` counts what really stays alive: every storage an op created during
  forward that is still referenced once forward returns, whoever holds it (autograd's saved
  tensors, a checkpoint's inputs, selective checkpointing's cache of matmul outputs). Without
  checkpointing it agrees with ``saved_tensor_bytes`` up to the model output; the tests hold it
  to that.

Both are device-independent (no allocator statistics), so they work on CPU and give the same
figure on GPU. ``saved_activation_bytes`` keeps every forward intermediate alive until it has
counted, so it needs up to twice the step's activation memory: use it on probe-sized batches.

A third, ``live_tensor_bytes`` + ``step_tensor_peak``, is the CPU's answer to
``torch.cuda.max_memory_allocated()``: the tensors alive before a step plus the highest the
step's own allocations climb above them, read from torch.profiler's allocation events. Unlike a
process's resident memory it leaves out what the allocator keeps after a free and what the
compiler holds, so it measures the training technique rather than the process around it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["saved_activation_bytes", "saved_tensor_bytes", "live_tensor_bytes", "step_tensor_peak"]


def _tensors(tree):
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


class _FreshStorageRecorder(TorchDispatchMode):
    """Holds one reference to every storage first seen as an op's output (not as an input).

    A storage first seen as an input existed before forward (parameters, the batch, cached
    masks), and so do the views of it that ops return; those are not activations.
    """

    def __init__(self):
        super().__init__()
        self.seen: set = set()
        self.fresh: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors((args, kwargs)):
            if t.layout == torch.strided and t.untyped_storage().data_ptr():
                self.seen.add(_storage_key(t))
        out = func(*args, **kwargs)
        for t in _tensors(out):
            if t.layout != torch.strided or not t.untyped_storage().data_ptr():
                continue
            key = _storage_key(t)
            if key not in self.seen:
                self.seen.add(key)
                self.fresh[key] = t.untyped_storage()
        return out


def _split(batch):
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None


def saved_activation_bytes(model: nn.Module, loss_fn, batch) -> int:
    """Bytes of forward intermediates still alive after ``loss_fn(model(inputs), targets)``.

    That is the activation memory a step holds at its peak (just before backward), with or
    without checkpointing. The loss itself is not counted. Runs one forward (no backward).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    >>> batch = (torch.randn(4, 8), torch.randn(4, 8))
    >>> saved_activation_bytes(net, torch.nn.functional.mse_loss, batch) > 0
    True
    """
    inputs, targets = _split(batch)
    recorder = _FreshStorageRecorder()
    with recorder:
        out = model(inputs)
        loss = loss_fn(out, targets) if targets is not None else loss_fn(out)
    del out
    loss_keys = {_storage_key(t) for t in _tensors(loss)}
    total = 0
    for key, storage in recorder.fresh.items():
        # One reference is the recorder's own; any other means something still holds it.
        if key not in loss_keys and torch._C._storage_Use_Count(storage._cdata) > 1:
            total += storage.nbytes()
    del loss, recorder
    return total


def saved_tensor_bytes(model: nn.Module, loss_fn, batch) -> int:
    """Bytes of distinct storages autograd saves for backward (parameters and the batch excluded).

    The reference measure: exact for a model without checkpointing, blind inside checkpoint
    regions (see the module docstring).
    """
    inputs, targets = _split(batch)
    excluded = {_storage_key(t) for t in _tensors([list(model.parameters()), list(model.buffers()), inputs, targets])}
    saved: dict = {}

    def pack(t):
        if t.layout == torch.strided:
            try:
                key = _storage_key(t)
            except (NotImplementedError, RuntimeError):  # saved inside a vmap: no storage of its own
                return t
            if key not in excluded:
                saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs)
        loss = loss_fn(out, targets) if targets is not None else loss_fn(out)
    del out, loss
    return sum(saved.values())


_PLAIN = (torch.Tensor, nn.Parameter)


def live_tensor_bytes(device: str = "cpu") -> int:
    """Bytes of the distinct storages on ``device`` that live Python tensors hold (a gc scan).

    Tensors only C++ holds (an autograd graph between forward and backward, a DDP bucket) are not
    seen, so take it between steps, where the model, its gradients and the optimizer state are all
    reachable from Python.
    """
    import gc

    storages = {}
    for obj in gc.get_objects():
        # plain tensors and parameters only: a subclass either wraps plain tensors the scan finds
        # anyway (DTensor's local shard) or has no real storage (the compiler's FakeTensors)
        if type(obj) in _PLAIN and obj.device.type == device and obj.layout == torch.strided:
            try:
                storages[_storage_key(obj)] = obj.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):
                # a plain-typed wrapper with no storage of its own (a vmap BatchedTensor a compiled
                # model's trace left behind): what it wraps is a plain tensor the scan finds
                continue
    return sum(storages.values())


def step_tensor_peak(run) -> int:
    """The highest the bytes of CPU tensors allocated (net of their frees) by ``run()`` climb.

    Read from torch.profiler's memory events, so it sees every allocation of the CPU allocator,
    inside compiled code too. A tensor allocated before ``run`` and freed inside it is not
    subtracted (the profiler never saw its size), so the figure can only err upwards.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    cpu = torch._C._autograd.DeviceType.CPU
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == cpu)
    level = peak = 0
    for _, delta in deltas:
        level += delta
        peak = max(peak, level)
    return peak
