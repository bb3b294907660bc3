"""``prepare()``: wrap a model for data-parallel training and hand the Engine one ``CommState``.

Dense gradients go through torch DDP (bucketed, overlapped with backward) with one of the hooks
in hooks.py / powersgd.py / onebit.py; sparse embedding gradients, when asked, bypass DDP and are
exchanged as (index, row) pairs. Everything that has to survive a restart (hook counters,
PowerSGD's Q and errors, 1-bit Adam's errors) is in ``CommState.state_dict()``.

>>> # under torchrun:  model, opt, comm_state = prepare(model, opt, DataParallelConfig(), device)
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import ConfigError, HardwareError
from .config import DataParallelConfig
from .env import init, is_initialized
from .hooks import CAST_DTYPES, HookState, allreduce_hook, cast_hook
from .onebit import OneBitAdam, onebit_hook
from .powersgd import PowerSGDState, powersgd_hook
from .agree import build_plan, preflight
from .sparse import SparseExchange, allgather_sparse_mean, sparse_embedding_params
from .strategies import ParameterServerState, parameter_server_hook, ps_sparse_mean

__all__ = ["CommState", "prepare", "convert_batchnorm", "to_onebit_adam"]


class CommState:
    """The Engine's handle on communication: sync control, skip agreement, counters, checkpoint state."""

    def __init__(self, model: DDP, dp: DataParallelConfig, hook_state: HookState, optimizer=None,
                 sparse: SparseExchange | None = None, group=None):
        self.model = model
        self.dp = dp
        self.hook_state = hook_state
        self.optimizer = optimizer
        self.sparse = sparse
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.aux_calls = 0
        """Collectives outside the gradient exchange (inf agreement, averaged scalars)."""

    @property
    def collective_count(self) -> int:
        """Gradient-exchange rounds so far: one per optimizer step, however many micro-batches."""
        return self.hook_state.rounds

    @property
    def collective_calls(self) -> int:
        """Individual collectives the gradient exchange issued (rounds x buckets x per-bucket calls)."""
        return self.hook_state.calls

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank handed to the gradient exchange's collectives so far (dense hooks,
        1-bit Adam's momentum exchange, sparse exchange); see HookState.bytes_sent for the convention."""
        return self.hook_state.bytes_sent

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next one outside communicates."""
        if self.sparse is not None:
            self.sparse.enabled = False
        try:
            with self.model.no_sync():
                yield
        finally:
            if self.sparse is not None:
                self.sparse.enabled = True

    def agree_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        """Max of the inf/NaN flag over ranks, so every rank skips the same steps."""
        flag = found_inf.detach().to(torch.float32).reshape(-1).clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.aux_calls += 1
        return flag.reshape(found_inf.shape).to(found_inf.dtype)

    def average_scalar(self, value) -> torch.Tensor:
        """Mean of a scalar (tensor or float) over ranks, e.g. the loss for logging."""
        device = next(self.model.parameters()).device
        t = torch.as_tensor(value, dtype=torch.float32, device=device).detach().clone().reshape(1)
        dist.all_reduce(t, group=self.group)
        self.aux_calls += 1
        return (t / self.world_size).reshape(())

    def state_dict(self) -> dict:
        sd = {"hook": self.hook_state.state_dict(), "aux_calls": self.aux_calls}
        if isinstance(self.optimizer, OneBitAdam):
            # progress, the freeze's mask and the errors: the Engine saves Adam's per-parameter
            # state itself but not what OneBitAdam.state_dict() adds to it
            sd["onebit"] = self.optimizer.onebit_state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.hook_state.load_state_dict(sd.get("hook", {}))
        self.aux_calls = int(sd.get("aux_calls", 0))
        if "onebit" in sd and isinstance(self.optimizer, OneBitAdam):
            saved = sd["onebit"]
            if "worker_error" in saved:  # saved before the optimizer carried it: errors only
                saved = {**self.optimizer.onebit_state_dict(), "compressor": saved}
            self.optimizer.load_onebit_state_dict(saved)


def convert_batchnorm(model: nn.Module, dp: DataParallelConfig, group=None) -> nn.Module:
    """SyncBatchNorm when ``dp.sync_bn`` (parameters are kept, so the optimizer stays valid), else unchanged.

    Statistics are reduced over ``group`` (None: the world), the same ranks DDP averages over.
    """
    if not dp.sync_bn:
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)


def to_onebit_adam(optimizer: torch.optim.Optimizer, warmup_steps: int, group=None) -> OneBitAdam:
    """A OneBitAdam over the same parameters and hyperparameters as a torch Adam/AdamW."""
    if isinstance(optimizer, OneBitAdam):
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(
            f"compression='onebit' is 1-bit Adam and needs an Adam optimizer, got {type(optimizer).__name__}; "
            "pass turbotrain.comm.OneBitAdam(model.parameters(), lr=...) or torch.optim.Adam/AdamW"
        )
    d = optimizer.defaults
    if d.get("amsgrad"):
        raise ConfigError("compression='onebit' cannot run AMSGrad; build the Adam with amsgrad=False")
    if type(optimizer) is torch.optim.Adam and d.get("weight_decay"):
        raise ConfigError(
            "Adam's L2 weight decay is coupled to the gradient, which 1-bit Adam does not all-reduce after "
            "warm-up; use torch.optim.AdamW (decoupled decay) or weight_decay=0"
        )
    groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
              for g in optimizer.param_groups]
    return OneBitAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d.get("weight_decay", 0.0),
                      warmup_steps=warmup_steps, group=group)


def _onebit_hook(state: HookState, bucket):
    # Warm-up: exact all-reduce; afterwards only what the optimizer keeps exact (small tensors,
    # elements with v = 0 at the freeze) is all-reduced, and its momentum exchange does the rest.
    return onebit_hook(state, bucket)


def _side_group(group, world: int):
    """A second group over the same ranks, for collectives launched from completion callbacks."""
    if world == 1:
        return None
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks, use_local_synchronization=True)


def _make_hook(dp: DataParallelConfig, group, world: int, names: dict):
    if dp.strategy == "parameter_server":
        state = ParameterServerState(group=group, world_size=world, wire_dtype=CAST_DTYPES.get(dp.compression),
                                     servers=dp.ps_servers, rank=dist.get_rank(group),
                                     side_group=_side_group(group, world))
        return state, parameter_server_hook
    if dp.compression is None:
        return HookState(group=group, world_size=world), allreduce_hook
    if dp.compression in CAST_DTYPES:
        return HookState(group=group, world_size=world, wire_dtype=CAST_DTYPES[dp.compression]), cast_hook
    if dp.compression == "powersgd":
        state = PowerSGDState(group=group, world_size=world, rank=dp.powersgd_rank,
                              warmup_steps=dp.warmup_steps, names=names, side_group=_side_group(group, world))
        return state, powersgd_hook
    return HookState(group=group, world_size=world), _onebit_hook


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, dp: DataParallelConfig | None,
            device: torch.device | str | None = None, *, group=None):
    """Wrap ``model`` in DDP with ``dp``'s compression; returns ``(ddp_model, optimizer, CommState)``.

    Starts torch.distributed from the launcher's variables if nobody has yet, then checks that
    every rank has the same plan before any gradient collective can hang on a mismatch.
    """
    dp = dp if isinstance(dp, DataParallelConfig) else DataParallelConfig()
    if dp.compression == "onebit" and not isinstance(optimizer, OneBitAdam):
        # 1-bit Adam is an optimizer the user chooses; swapping it in behind their back would step
        # another object than the one they hold.
        raise ConfigError(
            f"compression='onebit' is 1-bit Adam, but the optimizer is {type(optimizer).__name__}; pass "
            "turbotrain.comm.OneBitAdam(params, lr=..., warmup_steps=...) (or to_onebit_adam(adam_optimizer, "
            "warmup_steps)) as the optimizer"
        )
    if not is_initialized():
        init()
    world = dist.get_world_size(group)
    backend = dist.get_backend(group)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if dp.compression == "onebit" and dp.warmup_steps < 1:
        raise ConfigError("compression='onebit' needs warmup_steps >= 1 to measure the variance it freezes")
    if dp.strategy != "ring" and dp.ps_servers > world:
        raise ConfigError(f"ps_servers={dp.ps_servers} is more than the {world} ranks of the group; "
                          f"choose 1..{world}")

    sparse_params = sparse_embedding_params(model)
    if sparse_params and not dp.sparse_embeddings:
        raise ConfigError(
            f"{', '.join(sparse_params)} produce sparse gradients, which the dense DDP hooks cannot carry; "
            "set DataParallelConfig(sparse_embeddings=True) or build the embedding with sparse=False"
        )
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if dp.sync_bn and has_bn and device.type == "cpu" and world > 1:
        raise HardwareError(
            "sync_bn=True: torch's SyncBatchNorm runs on CUDA only and this job trains on CPU; "
            "drop sync_bn (per-rank statistics) or train on GPUs with NCCL"
        )
    model = convert_batchnorm(model, dp, group).to(device)

    preflight(build_plan(model, dp, world_size=world, backend=backend, optimizer=optimizer), group, device)

    if sparse_params:
        # DDP neither broadcasts nor reduces ignored parameters; start them equal here.
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(sparse_params))
        for p in sparse_params.values():
            dist.broadcast(p.data, src=0, group=group)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=dp.bucket_mb,
        gradient_as_bucket_view=True,
        find_unused_parameters=dp.find_unused_parameters,
    )
    names = {id(p): n for n, p in model.named_parameters()}
    hook_state, hook = _make_hook(dp, group, world, names)
    if isinstance(optimizer, OneBitAdam):
        hook_state.extra["optimizer"] = optimizer
        optimizer.compressor.bind(group)  # the optimizer may predate init()
        optimizer.compressor.hook_state = hook_state
    ddp.register_comm_hook(hook_state, hook)
    sparse = None
    if sparse_params:
        mean = allgather_sparse_mean
        if isinstance(optimizer, OneBitAdam):  # their gradients arrive averaged, sparsely: no 1-bit for them
            optimizer.keep_exact(sparse_params.values())
        if dp.strategy in ("parameter_server", "hybrid"):
            mean = functools.partial(ps_sparse_mean, servers=dp.ps_servers)
        sparse = SparseExchange(sparse_params, group, hook_state, mean)
    if world == 1:
        warnings.warn("data_parallel with world size 1: DDP wraps the model but nothing is exchanged", stacklevel=2)
    return ddp, optimizer, CommState(ddp, dp, hook_state, optimizer, sparse, group)
