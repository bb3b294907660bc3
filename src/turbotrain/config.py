"""The one configuration object every Engine takes.

Each field belongs to one subpackage (precision/, fusion/, comm/, memory/, diagnose/); nothing is
switched on unless it is named here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace

from .comm.config import DataParallelConfig
from .errors import ConfigError, check_bool, check_choice, check_number
from .guards import GuardConfig, check_guards
from .parallel.config import ParallelConfig
from .precision.config import PRECISIONS, LossScaleConfig

__all__ = ["Config", "ATTENTION_MODES", "CHECKPOINT_MODES", "DEVICES", "FUSION_PATTERNS"]

CHECKPOINT_MODES = (None, "blocks", "selective")
DEVICES = ("auto", "cpu", "cuda")
#: ``Config(attention=...)``: how compiled steps run scaled_dot_product_attention.
ATTENTION_MODES = ("auto", "plain", "stock")
#: Pattern names ``Config(fuse=(...))`` and ``turbotrain.fusion.fuse(patterns=...)`` accept.
FUSION_PATTERNS = ("linear_act", "qkv", "layernorm_gelu", "swiglu", "linear_cross_entropy")


@dataclass(frozen=True)
class Config:
    """How an Engine trains. Invalid values raise ConfigError listing the valid choices.

    >>> Config(precision="bf16-master", accumulate=4, clip_grad_norm=1.0).accumulate
    4
    >>> Config.from_dict(Config(fuse=("qkv",)).to_dict()).fuse
    ('qkv',)
    """

    precision: str = "fp32"
    """'fp32', 'bf16-mixed'/'fp16-mixed' (autocast), 'bf16-master'/'fp16-master' (model in low
    precision, FP32 master weights in the optimizer) or 'auto' (chosen from the hardware, printed)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling; used by the fp16 modes only."""
    keep_fp32_head: bool = False
    """Also keep the classifier head (the last Linear feeding the loss) in FP32."""
    accumulate: int = 1
    """Micro-batches per optimizer step; gradients are communicated once per step."""
    clip_grad_norm: float | None = None
    """Clip the global gradient L2 norm to this value (after unscaling), or None."""
    fuse: bool | str | tuple[str, ...] = False
    """True for the patterns that pay on the run's device and mode (on a CPU, or under compile, the
    linear+cross-entropy head alone: fusion.transform.patterns_for, which logs what it left out and
    why), 'all' for every pattern, a tuple of names from FUSION_PATTERNS, or False."""
    compile: bool = False
    """Run the model through torch.compile (with sequence-length bucketing)."""
    attention: str = "auto"
    """Under compile: 'plain' runs scaled_dot_product_attention as matmuls and an FP32 softmax that
    Inductor fuses (causal blocks past the diagonal skipped; fusion/attention.py), 'stock' keeps
    torch's kernel, 'auto' is 'plain' on a CPU in bf16 (where the stock op is the CPU flash kernel)
    and 'stock' elsewhere or with activation checkpointing. 'plain' keeps FP32 scores for the
    backward: more memory at long T."""
    seq_buckets: tuple[int, ...] | None = None
    """Sequence lengths batches are padded up to when compiling, so shapes stay few."""
    checkpoint: str | None = None
    """Activation checkpointing: None, 'blocks' (every block) or 'selective' (keep matmul outputs)."""
    checkpoint_every: int = 1
    """With ``checkpoint``: apply it to every Nth block only (blocks 0, N, 2N, ...; 1: all of them).
    2 keeps about half the activations for about half the recomputation: a point between none
    and all for a length where all blocks would cost more time than the memory is worth."""
    data_parallel: DataParallelConfig | bool | None = None
    """True or a DataParallelConfig to train data-parallel over torch.distributed."""
    parallel: ParallelConfig | bool | None = None
    """True or a ParallelConfig to shard the model (FSDP2, HSDP, tensor/sequence parallel); not with data_parallel."""
    nan_check: bool = False
    """One fused finiteness test of the loss per step; on failure find the origin module."""
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    sync_stats: bool = False
    """Copy StepStats tensors to host floats every step (a device sync); off by default."""
    track_grad_norm: bool = False
    """Report the global gradient norm in StepStats even without clipping (one extra pass)."""
    guards: GuardConfig | bool | None = None
    """True or a GuardConfig: an FP32 shadow check every N steps and self-healing precision (guards.py)."""

    def __post_init__(self):
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        check_choice("device", self.device, DEVICES)
        check_choice("attention", self.attention, ATTENTION_MODES)
        if self.attention == "plain" and not self.compile:
            raise ConfigError("attention='plain' replaces the attention kernel inside the compiled graph, and "
                              "compile is off; set compile=True, or leave attention='auto'")
        if self.attention == "plain" and self.checkpoint is not None:
            raise ConfigError(f"attention='plain' with checkpoint={self.checkpoint!r} is not supported: the "
                              "recomputation in backward would run the stock kernel where the forward ran plain "
                              "attention; leave attention='auto' (the stock kernel under checkpointing) or drop "
                              "checkpoint")
        for name in ("keep_fp32_head", "compile", "nan_check", "sync_stats", "track_grad_norm"):
            check_bool(name, getattr(self, name))
        check_number("accumulate", self.accumulate, integer=True, minimum=1)
        check_number("checkpoint_every", self.checkpoint_every, integer=True, minimum=1)
        if self.checkpoint_every != 1 and self.checkpoint is None:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every} picks the blocks activation checkpointing "
                              "applies to, and checkpoint is None; set checkpoint='blocks' (or 'selective') too, or "
                              "drop checkpoint_every")
        if self.clip_grad_norm is not None:
            check_number("clip_grad_norm", self.clip_grad_norm, minimum=0, exclusive=True)
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise ConfigError(
                f"loss_scale={self.loss_scale!r} is not valid; pass a turbotrain.LossScaleConfig "
                "(Config.from_dict builds one from a dict)"
            )
        object.__setattr__(self, "fuse", _normalise_fuse(self.fuse))
        object.__setattr__(self, "data_parallel", _normalise_dp(self.data_parallel))
        object.__setattr__(self, "parallel", _normalise_parallel(self.parallel))
        if self.data_parallel is not None and self.parallel is not None:
            raise ConfigError(
                "data_parallel and parallel were both given; choose one: parallel=ParallelConfig(...) shards the "
                "model (FSDP2; dp_shard=1 with dp_replicate=N replicates it like DDP), data_parallel=True "
                "replicates it with DDP and its gradient compression"
            )
        object.__setattr__(self, "seq_buckets", _normalise_buckets(self.seq_buckets))
        object.__setattr__(self, "guards", _normalise_nested("guards", self.guards, GuardConfig,
                                                             "turbotrain.GuardConfig"))
        check_guards(self.guards, self.loss_scale)

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain-JSON form, for benchmark rows and checkpoints."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if hasattr(value, "__dataclass_fields__"):
                value = {g.name: getattr(value, g.name) for g in fields(value)}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """The inverse of to_dict: nested dicts become LossScaleConfig / DataParallelConfig / ParallelConfig /
        GuardConfig.

        Unknown keys raise ConfigError (a typo must not fall back to a default silently).
        """
        values = _known_fields(cls, d, "Config")
        for name, nested in (("loss_scale", LossScaleConfig), ("data_parallel", DataParallelConfig),
                             ("parallel", ParallelConfig), ("guards", GuardConfig)):
            if isinstance(values.get(name), dict):
                values[name] = nested(**_known_fields(nested, values[name], name))
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        """``Config.from_dict(json.loads(text))``, with a ConfigError for text that is not JSON."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"Config.from_json needs a JSON object such as '{{\"accumulate\": 4}}' ({exc})") from exc
        return cls.from_dict(d)


def _known_fields(cls, d, what: str) -> dict:
    """A copy of ``d`` after checking it is a dict whose keys are all fields of dataclass ``cls``."""
    if not isinstance(d, dict):
        raise ConfigError(f"{what} must be a dict of settings, got {type(d).__name__}")
    names = [f.name for f in fields(cls)]
    unknown = [k for k in d if k not in names]
    if unknown:
        raise ConfigError(
            f"unknown {what} setting(s) {', '.join(repr(k) for k in unknown)}; valid: {', '.join(names)}"
        )
    return dict(d)


def _normalise_fuse(value) -> bool | tuple[str, ...]:
    """True stays True (resolved against the device and compile when the Engine is built); 'all' is
    every pattern; a name or a list of names becomes a tuple; False and None become ()."""
    if value is True:
        return True
    if value == "all":
        return FUSION_PATTERNS
    if value is False or value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise ConfigError(
            f"fuse={value!r} is not valid; use True, 'all', False or a tuple of pattern names from: "
            + ", ".join(repr(p) for p in FUSION_PATTERNS)
        )
    patterns = tuple(value)
    for name in patterns:
        check_choice("fuse pattern", name, FUSION_PATTERNS)
    return patterns


def _normalise_buckets(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    example = "such as (128, 256, 512)"
    if not isinstance(value, (tuple, list)) or not value:
        raise ConfigError(f"seq_buckets={value!r} is not valid; use None or a tuple of positive integers {example}")
    for b in value:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError(f"seq_buckets={value!r} is not valid; each bucket must be a positive integer ({example})")
    return tuple(sorted(set(value)))


def _normalise_nested(name: str, value, cls: type, spelled: str):
    """True -> cls(), False/None -> None, an instance as it is; anything else a ConfigError."""
    if value is True:
        return cls()
    if value is False or value is None:
        return None
    if not isinstance(value, cls):
        raise ConfigError(f"{name}={value!r} is not valid; use True, False, None or a {spelled}")
    return value


def _normalise_parallel(value) -> ParallelConfig | None:
    return _normalise_nested("parallel", value, ParallelConfig, "turbotrain.parallel.ParallelConfig")


def _normalise_dp(value) -> DataParallelConfig | None:
    return _normalise_nested("data_parallel", value, DataParallelConfig, "turbotrain.DataParallelConfig")
