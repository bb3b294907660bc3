"""The parallel transform: tensor parallel, then FSDP2, over one device mesh.

``Config(parallel=ParallelConfig(...))``. The Engine applies it after fusion and activation
checkpointing (which it shards as they left the model) and before precision:

    place(device)   the process group from the launcher's variables, this rank's GPU, the mesh
    apply(...)      rank 0's weights to every rank; tensor parallel over "tp"
                    (tp_plans.py); fully_shard on each norm (FP32), each block and the root over
                    "dp_shard" (with "dp_replicate": HSDP); a model built on the meta device is
                    sharded there, then each rank allocates and initialises its shards (meta_init.py)
    accumulate      set_requires_gradient_sync(closes_step): one reduce-scatter per optimizer step
    before step     the fp16 inf/NaN flag agreed across every rank (MAX)

FSDP2's sharded FP32 parameters are the masters the optimizer updates, and its
``MixedPrecisionPolicy`` gathers them in the run's low-precision dtype for compute. So the plan says
``plan.sharded = True`` and maps every parameter to its sharded replacement in ``plan.master_of``:
the optimizer is bound to the shards, and the precision transform must neither cast the model nor
make masters of its own. When the Engine's set-up ends the plan keeps each stock name's shard in
``plan.stock_layout`` and drops those entries (ModelPlan.settle), so no rank keeps the unsharded
parameters of an eager build.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict

import torch
from torch import nn

from ..errors import ConfigError
from ..plan import ApplyContext, ModelPlan, StepContext, Transform
from .config import MESH_DIMS, ParallelConfig, ResolvedDegrees

__all__ = ["ParallelTransform", "build_mesh", "data_parallel_mesh", "mixed_precision_policies", "agree_found_inf"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())


def build_mesh(degrees: ResolvedDegrees, device_type: str):
    """The device mesh: "dp_replicate" (when above 1), "dp_shard" (always), "cp", "tp" (when above 1).

    dp_shard is kept even at size 1: FSDP needs a mesh to run on, and its mixed-precision policy is
    what computes in bf16 from FP32 shards, tensor-parallel-only runs included. dp_replicate joins
    it as the outer dimension because FSDP2 is HSDP when handed a 2-D (replicate, shard) mesh.
    """
    from torch.distributed.device_mesh import init_device_mesh

    sizes = dict(zip(MESH_DIMS, (degrees.dp_replicate, degrees.dp_shard, degrees.cp, degrees.tp)))
    dims = [n for n in MESH_DIMS if sizes[n] > 1 or n == "dp_shard"]
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in dims), mesh_dim_names=tuple(dims))
    if "cp" in dims:
        # FSDP shards over the cp ranks too (they hold the same weights), so their gradients are averaged;
        # flattened here, on every rank at once, since making its process group is a collective.
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def data_parallel_mesh(mesh):
    """The mesh FSDP runs on: (dp_replicate, dp_shard) for HSDP, else dp_shard; with cp, dp_shard x cp flattened."""
    names = mesh.mesh_dim_names
    if "cp" in names:
        from torch.distributed.device_mesh import DeviceMesh

        # The flattened mesh build_mesh made (returned again, no new group); slicing it from the root
        # mesh by name is deprecated in torch, so HSDP's 2-D mesh is put together from the two parts.
        shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return DeviceMesh._concatenate([mesh["dp_replicate"], shard]) if "dp_replicate" in names else shard
    return mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else mesh["dp_shard"]


def mixed_precision_policies(low: torch.dtype | None):
    """(blocks and root, norms, FP32-kept head) FSDP policies for the run's low-precision dtype.

    fp32: no policy (and no groups of their own for norms or head: None). bf16/fp16: gather the FP32
    shards in ``low`` for compute, reduce gradients in FP32 (a bf16 sum over many ranks would lose
    the small ones). Norms keep FP32 weights and compute in FP32, handing their result on in ``low``
    so the next matmul stays in low precision; a head kept FP32 also returns FP32 logits.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if low is None:
        return MixedPrecisionPolicy(), None, None
    fp32 = torch.float32
    return (MixedPrecisionPolicy(param_dtype=low, reduce_dtype=fp32),
            MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32, output_dtype=low),
            MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32))


def _broadcast_from_rank0(model: nn.Module) -> None:
    # FSDP cuts each rank's own copy of a weight into shards; ranks that initialised differently (an
    # unseeded model) would train a model nobody built. DDP broadcasts for the same reason. A meta
    # tensor has nothing to send: every rank replays the same recorded init (meta_init.py).
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not tensor.is_meta:
                dist.broadcast(tensor.data, src=0)


def _norm_modules(model: nn.Module, norm_params: set) -> list[nn.Module]:
    return [m for m in model.modules()
            if (own := list(m.parameters(recurse=False))) and all(p in norm_params for p in own)]


class ParallelTransform(Transform):
    """Shard the model over the mesh ParallelConfig describes (see the module docstring).

    Driven like the Engine drives it::

        t = ParallelTransform(ParallelConfig(dp_shard=-1))
        device = t.place(torch.device("cpu"))          # process group + mesh
        plan = ModelPlan(); plan.record_norms(model)
        t.apply(model, plan, ApplyContext(device))     # model is now sharded in place
        opt = torch.optim.AdamW(model.parameters())    # over the shards
    """

    name = "parallel"

    def __init__(self, config: ParallelConfig, keep_fp32_head: bool = False, compile: bool = False):
        if not isinstance(config, ParallelConfig):
            raise ConfigError(f"ParallelTransform needs a turbotrain.parallel.ParallelConfig, got {config!r}")
        self.config = config
        self.keep_fp32_head = keep_fp32_head
        self.compile = compile
        """Config.compile: refused with tensor parallel on a layout that does not compile right."""
        self.degrees: ResolvedDegrees | None = None
        self.mesh = None
        """The DeviceMesh once placed."""
        self.root = None
        """The FSDP root module once applied."""
        self.layout = None
        """The tensor-parallel layout used (tp > 1)."""
        self._low: torch.dtype | None = None
        self.meta_init = None
        """A model built on the meta device: the InitTape (meta_init.record_init) that apply replays into
        each rank's shards. The Engine records it when it is given the model."""

    # -- before the model moves ----------------------------------------------------------------
    def place(self, device: torch.device) -> torch.device:
        import torch.distributed as dist

        from ..comm.env import init, is_initialized, read_launch_env

        # The degrees are checked against the launcher's world size before any process meets another.
        world = dist.get_world_size() if is_initialized() else read_launch_env().world_size
        self.degrees = self.config.resolve(world)
        info = init()
        if device.type == "cuda":
            device = torch.device("cuda", info.local_rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(device)
        self.mesh = build_mesh(self.degrees, device.type)
        return device

    # -- the model ------------------------------------------------------------------------------
    def apply(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        if self.mesh is None:
            self.place(ctx.device)
        self._check_meta(model)
        self._low = ctx.dtype
        layout = None
        if self.degrees.tp > 1:
            from .tp_plans import check_model, find_layout

            layout = find_layout(model)
            check_model(model, layout, self.degrees.tp)  # a model the plan cannot split fails before any collective
            if self.compile and not layout.compiles:
                raise ConfigError(
                    f"compile=True with tensor parallel (tp={self.degrees.tp}) trains the {layout.family} plan wrong "
                    "in this torch; use compile=False with tp, or shard with FSDP2 alone "
                    "(ParallelConfig(dp_shard=...)), which compiles")
            if self.compile and self.config.loss_parallel and not layout.compiles_loss_parallel:
                raise ConfigError(
                    f"compile=True with tensor parallel (tp={self.degrees.tp}) and ParallelConfig(loss_parallel=True) "
                    f"fails on the {layout.family} plan in this torch: a compiled graph between the model's graph "
                    "breaks hands out the vocabulary-sharded logits DTensor, and AOTAutograd's backward gets a plain "
                    "tangent for it. Set ParallelConfig(loss_parallel=False) (logits gathered; compiles and trains "
                    "like eager), or compile=False")
        if self.degrees.cp > 1:
            from .context import check_cp_model

            check_cp_model(model, self.degrees.cp)  # before any collective, like the tp checks
        before = dict(model.named_parameters())
        norms_before = {n for n, p in before.items() if p in plan.norm_params}
        norm_modules = _norm_modules(model, plan.norm_params)  # before tensor parallel replaces their weights
        _broadcast_from_rank0(model)
        if layout is not None:
            self._tensor_parallel(model, layout, plan)
        self._fully_shard(model, plan, norm_modules)
        if self.meta_init is not None:
            self._materialise(model, plan, ctx.device)
        after = dict(model.named_parameters())
        for name, p in before.items():
            plan.master_of[p] = after[name]  # the FP32 shard the optimizer steps stands for the parameter
        plan.norm_params = {after[n] for n in norms_before}
        plan.sharded = True
        plan.mesh = self.mesh

    def _check_meta(self, model: nn.Module) -> None:
        from ..errors import MetaInitError
        from .meta_init import has_meta_tensors

        if self.meta_init is None and has_meta_tensors(model):
            raise MetaInitError("the model is on the meta device, but nothing recorded how to initialise it; pass it "
                                "to Engine(model, ..., init_weights=fn), or set ParallelTransform.meta_init = "
                                "turbotrain.parallel.record_init(model, fn) before apply")
        if self.meta_init is not None and (self.degrees.tp > 1 or self.degrees.cp > 1):
            raise MetaInitError(f"a model built on the meta device with tp={self.degrees.tp}, cp={self.degrees.cp} is "
                                "not supported yet (FSDP2 and HSDP alone are); set tp=1 and cp=1")

    def _materialise(self, model: nn.Module, plan: ModelPlan, device: torch.device) -> None:
        tape, self.meta_init = self.meta_init, None  # its constants are not kept past this
        full = tape.nbytes()
        tape.materialise(model, device)
        plan.notes.append(f"parallel: built on the meta device; each rank allocated its shards and initialised them "
                          f"one whole parameter at a time ({full / 2**20:.1f} MiB unsharded)")

    def _tensor_parallel(self, model: nn.Module, layout, plan: ModelPlan) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from . import tp_plans

        tp, sp = self.degrees.tp, self.config.sequence_parallel
        tp_mesh = self.mesh["tp"]
        for i, block in enumerate(model.get_submodule(layout.blocks)):
            parallelize_module(block, tp_mesh, tp_plans.block_plan(layout, sp, first=i == 0))
            if layout.local_heads is not None:
                layout.local_heads(block, tp)
        lp = self.config.loss_parallel
        parallelize_module(model, tp_mesh, tp_plans.root_plan(layout, sp, lp))
        tp_plans.hand_over_own_tensors(model, layout, sp, lp)
        tp_plans.embedding_outside_compile(model, layout)
        self.layout = layout
        plan.notes.append(f"parallel: tensor parallel over {tp} ranks with the {layout.family} plan"
                          + (" and sequence parallel" if sp else "")
                          + ("; logits kept sharded over the vocabulary, the cross-entropy computed on the shards "
                             "(loss_parallel)" if lp else "; logits gathered for the loss (loss_parallel=False)"))

    def _fully_shard(self, model: nn.Module, plan: ModelPlan, norm_modules: list[nn.Module]) -> None:
        from torch.distributed.fsdp import fully_shard

        from ..memory import find_block_list

        mesh = data_parallel_mesh(self.mesh)
        policy, norm_policy, head_policy = mixed_precision_policies(self._low)
        reshard = self.config.reshard_after_forward
        if norm_policy is not None:
            # Own FSDP groups for the FP32 modules: one group gathers one dtype.
            for module in norm_modules:
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=norm_policy)
            if self.keep_fp32_head and plan.head is not None:
                fully_shard(plan.head, mesh=mesh, reshard_after_forward=reshard, mp_policy=head_policy)
        try:
            _, blocks = find_block_list(model)
        except ConfigError:
            blocks = []
            plan.notes.append("parallel: no block list found, so FSDP shards the whole model as one group "
                              "(all of it is gathered at once)")
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        # The root (embeddings, head) is needed again as soon as backward starts: never resharded.
        self.root = fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)

    def wrap_runner(self, runner, plan: ModelPlan, ctx: ApplyContext):
        """With cp > 1: each cp rank runs forward and loss on its slice of the sequence (context.py).
        With loss parallel: the loss handed back as a plain tensor."""
        if self.layout is not None and self.config.loss_parallel:
            runner = _plain_loss(runner)
        if self.degrees is None or self.degrees.cp == 1:
            return runner
        from .context import context_parallel_runner

        if plan.loss_head is not None:
            raise ConfigError(f"the fused linear+cross-entropy head with context parallel (cp={self.degrees.cp}) is "
                              "not supported yet; drop 'linear_cross_entropy' from Config(fuse=...) or set cp=1")
        plan.notes.append(f"parallel: context parallel over {self.degrees.cp} ranks, each with T/{self.degrees.cp} of "
                          "every sequence; attention exchanges heads (all-to-all)")
        return context_parallel_runner(runner, self.root, self.mesh["cp"])

    # -- every step -----------------------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        # A forward and loss outside a training step (Engine.eval_loss) meets the sharded logits too.
        if self.layout is not None and self.config.loss_parallel:
            return _loss_parallel_scope(self.degrees.tp)
        return contextlib.nullcontext()

    def accumulate_context(self, closes_step: bool) -> contextlib.AbstractContextManager:
        if self.layout is not None and self.config.loss_parallel:
            # Forward, loss and backward: torch's loss_parallel() must see the backward too.
            return _sync_and_loss_parallel(self.root, closes_step, self.degrees.tp)
        return _gradient_sync(self.root, closes_step)

    def before_optimizer_step(self, ctx: StepContext) -> None:
        if ctx.found_inf is not None:
            ctx.found_inf = agree_found_inf(ctx.found_inf)

    def reset_grads(self) -> None:
        # After a failed forward/backward FSDP's per-iteration state must be reset before the next
        # one; after a good step it is idle and this only checks so. Before the root's first forward
        # (a batch refused before the model ran, as context parallel's checks do) it has none to reset.
        if self.root is not None and self.root._get_fsdp_state()._is_root is not None:
            self.root.reset_iter_state()

    def state_dict(self) -> dict:
        return {"degrees": asdict(self.degrees)} if self.degrees is not None else {}

    def describe(self) -> str:
        d = self.degrees
        if d is None:
            return "parallel (not placed yet)"
        parts = [f"dp_replicate={d.dp_replicate}", f"dp_shard={d.dp_shard}", f"tp={d.tp}"]
        if d.cp > 1:
            parts.append(f"cp={d.cp} (attention all-to-all over heads; FSDP over dp_shard x cp)")
        if self.config.sequence_parallel:
            parts.append("sequence parallel")
        kind = "HSDP" if d.dp_replicate > 1 and d.dp_shard * d.cp > 1 else "FSDP2"
        dtype = f"{str(self._low).removeprefix('torch.')} compute, fp32 shards and reduce, fp32 norms" \
            if self._low is not None else "fp32"
        zero = "ZeRO-3" if self.config.reshard_after_forward else "ZeRO-2 (kept gathered after forward)"
        return f"parallel {' '.join(parts)} ({kind}, {zero}, {dtype})"


@contextlib.contextmanager
def _gradient_sync(root, closes_step: bool):
    # Micro-batches before the last keep their (unsharded) gradients local; the last one's backward
    # reduce-scatters the sum once. Restored afterwards so a backward outside the Engine is synced.
    root.set_requires_gradient_sync(closes_step)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


_loss_parallel_depth = 0
"""How many _loss_parallel_scope()s are open (forward_context opens one inside accumulate_context)."""

#: What DTensor and loss_parallel() say when a loss does math on the sharded logits they cannot run.
_SHARDED_LOSS_ERRORS = ("DTensor", "loss_parallel", "sharding strategy", "sharding propagation")


@contextlib.contextmanager
def _loss_parallel_scope(tp: int):
    """torch's ``loss_parallel()``, re-entrant, and left even when the body raises.

    torch's context pops its cross-entropy handlers on leaving, so the inner of two nested ones would
    take them from the outer's backward; and it does not pop them when its body raises. An error the
    sharded logits caused is re-raised as a ConfigError naming the switch that gathers them.
    """
    from torch.distributed.tensor.parallel import loss_parallel

    from ..errors import TurbotrainError

    global _loss_parallel_depth
    context = loss_parallel() if _loss_parallel_depth == 0 else contextlib.nullcontext()
    context.__enter__()
    _loss_parallel_depth += 1
    try:
        yield
    except Exception as exc:
        text = str(exc)
        if isinstance(exc, TurbotrainError) or not any(m in text for m in _SHARDED_LOSS_ERRORS):
            raise
        raise ConfigError(
            f"a DTensor op failed in forward, loss or backward under tensor parallel (tp={tp}) with "
            f"ParallelConfig(loss_parallel=True) ({type(exc).__name__}: {text.splitlines()[0] if text else ''}). "
            "With loss_parallel the logits reach the loss as a DTensor sharded over the vocabulary, on which "
            "F.cross_entropy (class-index targets, no label_smoothing) runs sharded; for a loss that does other "
            "math on them set ParallelConfig(loss_parallel=False), which hands it plain, gathered logits") from exc
    finally:
        _loss_parallel_depth -= 1
        context.__exit__(None, None, None)


@contextlib.contextmanager
def _sync_and_loss_parallel(root, closes_step: bool, tp: int):
    with _gradient_sync(root, closes_step), _loss_parallel_scope(tp):
        yield


def _plain_loss(runner):
    """``runner`` with a DTensor loss (loss_parallel's, replicated over the tensor-parallel ranks) handed
    back as a plain tensor, so the rest of the step (check_loss, StepStats, ``.item()``) sees one; for a
    replicated loss ``full_tensor()`` is no collective, and the backward flows through it."""
    from torch.distributed.tensor import DTensor

    def run(*args, **kwargs):
        loss = runner(*args, **kwargs)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    return run


def agree_found_inf(flag: torch.Tensor) -> torch.Tensor:
    """The inf/NaN flag of every rank's gradient shards, MAX-reduced: all ranks skip a step or none."""
    import torch.distributed as dist

    agreed = flag.detach().clone().float()
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return agreed
