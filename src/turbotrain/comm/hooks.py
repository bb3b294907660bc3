"""DDP communication hooks built only on ``torch.distributed`` futures, so they run on gloo and NCCL.

torch's own bf16 hook refuses gloo, so the cast hooks here are written from the same primitive
that both backends implement. Every hook counts what it sends: ``HookState.rounds`` is the number
of gradient-exchange rounds (one per synchronising backward), the figure the accumulation tests
check, ``HookState.calls`` the number of collectives issued and ``HookState.bytes_sent`` the
payload bytes this rank handed to them (see ``HookState.count``).

Each hook divides by the world size *before* the collective: a sum of N fp16 gradients can
overflow fp16's 65504 where their mean does not.

Hooks with two dependent collectives per bucket (PowerSGD's P then Q, the parameter server's
reduce then broadcast) return a future at once and launch the second collective from the first
one's completion through ``OrderedSecondPhase``, so backward of the later buckets keeps running.
"""

# No `from __future__ import annotations`: DDP reads a comm hook's return annotation at run time.

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["HookState", "OrderedSecondPhase", "allreduce_hook", "cast_hook", "noop_hook", "CAST_DTYPES",
           "new_future", "completed"]

#: compression name -> wire dtype of the cast hooks.
CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class HookState:
    """What every hook shares: the group, counters, and per-compressor extras."""

    group: object = None
    world_size: int = 1
    rounds: int = 0
    """Gradient-exchange rounds completed (the last bucket of a backward closes one)."""
    calls: int = 0
    """Collectives issued by the gradient exchange (buckets x collectives per bucket, 1-bit Adam's too)."""
    bytes_sent: int = 0
    """Payload bytes this rank handed to those collectives: the whole tensor of an all_reduce, reduce
    or reduce_scatter, the whole send buffer of an all_to_all, its own part of an all_gather, the
    tensor of a broadcast on its source (0 elsewhere). What the algorithm then moves per link (a
    ring all-reduce: 2(n-1)/n of it) is the cost model's business (comm/model.py), not this count's."""
    wire_dtype: torch.dtype | None = None
    """For the cast hooks: bf16 or fp16."""
    side_group: object = None
    """A second process group over the same ranks for second-phase collectives (launched from
    completion callbacks, so their order must not interleave with the main group's); None: ``group``."""
    extra: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, nbytes: int, calls: int = 1) -> None:
        """Record ``calls`` collectives carrying ``nbytes`` of payload (thread-safe: callbacks count too)."""
        with self._lock:
            self.calls += calls
            self.bytes_sent += int(nbytes)

    def allreduce(self, tensor: torch.Tensor, group=None):
        """Sum ``tensor`` over ``group`` (default: the hook's) asynchronously; returns the torch Work."""
        self.count(tensor.numel() * tensor.element_size())
        return dist.all_reduce(tensor, group=self.group if group is None else group, async_op=True)

    def close_bucket(self, bucket) -> None:
        if bucket.is_last():
            with self._lock:
                self.rounds += 1

    def state_dict(self) -> dict:
        return {"rounds": self.rounds, "calls": self.calls, "bytes_sent": self.bytes_sent}

    def load_state_dict(self, sd: dict) -> None:
        self.rounds = int(sd.get("rounds", 0))
        self.calls = int(sd.get("calls", 0))
        self.bytes_sent = int(sd.get("bytes_sent", 0))


def new_future(device: torch.device) -> torch.futures.Future:
    """An empty future; on CUDA one that records the current streams when its result is set."""
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut = new_future(tensor.device)
    fut.set_result(tensor)
    return fut



class OrderedSecondPhase:
    """Launches each bucket's second collective once its first is done, in the order buckets came.

    gloo runs the queued collectives of a group on several threads, and completion callbacks run
    on those threads; a collective launched from a callback on the hook's own group could then be
    issued in a different order on each rank (rank 0: P1, Q1, P2; rank 1: P1, P2, Q1), which
    pairs mismatched buffers. So second phases go on ``HookState.side_group`` and each waits for
    the previous bucket's second phase to have been launched. Nothing waits inside a callback.
    """

    def __init__(self):
        self._last: torch.futures.Future = torch.futures.Future()
        self._last.set_result(None)

    def chain(self, first: torch.futures.Future, second: Callable, device: torch.device) -> torch.futures.Future:
        """``second(first_value)`` launches the second collective and returns a future of the bucket."""
        result = new_future(device)

        def finish(fut):
            try:
                result.set_result(fut.value())
            except BaseException as exc:  # surfaces in DDP's wait on the bucket, on this rank
                result.set_exception(exc)

        def launch(_):
            try:
                second(first.value()).add_done_callback(finish)
            except BaseException as exc:
                result.set_exception(exc)

        self._last = torch.futures.collect_all([first, self._last]).then(launch)
        return result


def allreduce_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Plain mean all-reduce in the bucket's own dtype (what DDP does by default), but counted."""
    buffer = bucket.buffer()
    buffer.div_(state.world_size)
    work = state.allreduce(buffer)
    state.close_bucket(bucket)
    return work.get_future().then(lambda fut: fut.value()[0])


def cast_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Mean all-reduce with the bucket cast to ``state.wire_dtype`` on the wire and back afterwards.

    A bucket already in the wire dtype (bf16 gradients) is divided and reduced in place: no cast,
    no copy. Otherwise the division is done in place in the bucket's precision (the bucket is
    overwritten with the mean anyway), then one cast to the wire.
    """
    buffer = bucket.buffer()
    if buffer.dtype == state.wire_dtype:
        return allreduce_hook(state, bucket)
    buffer.div_(state.world_size)
    wire = buffer.to(state.wire_dtype)
    work = state.allreduce(wire)
    state.close_bucket(bucket)

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def noop_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Leave the local gradient in place (counts the round, sends nothing)."""
    state.close_bucket(bucket)
    return completed(bucket.buffer())
