"""DDP communication hooks built only on ``dist.all_reduce`` futures, so they run on gloo and NCCL.

torch's own bf16 hook refuses gloo, so the cast hooks here are written from the same primitive
that both backends implement. Every hook counts what it sends: ``HookState.rounds`` is the number
of gradient-exchange rounds (one per synchronising backward), the figure the accumulation tests
check, and ``HookState.calls`` the number of collectives issued.

Each hook divides by the world size *before* the collective: a sum of N fp16 gradients can
overflow fp16's 65504 where their mean does not.
"""



from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["HookState", "allreduce_hook", "cast_hook", "noop_hook", "CAST_DTYPES"]

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
    """Collectives issued by hooks (buckets x collectives per bucket)."""
    wire_dtype: torch.dtype | None = None
    """For the cast hooks: bf16 or fp16."""
    extra: dict = field(default_factory=dict)

    def allreduce(self, tensor: torch.Tensor):
        """Sum ``tensor`` over the group asynchronously; returns the torch Work."""
        self.calls += 1
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def close_bucket(self, bucket) -> None:
        if bucket.is_last():
            self.rounds += 1

    def state_dict(self) -> dict:
        return {"rounds": self.rounds, "calls": self.calls}

    def load_state_dict(self, sd: dict) -> None:
        self.rounds = int(sd.get("rounds", 0))
        self.calls = int(sd.get("calls", 0))


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def allreduce_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Plain mean all-reduce in the bucket's own dtype (what DDP does by default), but counted."""
    buffer = bucket.buffer()
    buffer.div_(state.world_size)
    work = state.allreduce(buffer)
    state.close_bucket(bucket)
    return work.get_future().then(lambda fut: fut.value()[0])


def cast_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Mean all-reduce with the bucket cast to ``state.wire_dtype`` on the wire and back afterwards."""
    buffer = bucket.buffer()
    wire = buffer.div(state.world_size).to(state.wire_dtype)
    work = state.allreduce(wire)
    state.close_bucket(bucket)

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def noop_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Leave the local gradient in place (1-bit Adam after warm-up communicates momentum instead)."""
    return _completed(bucket.buffer())
