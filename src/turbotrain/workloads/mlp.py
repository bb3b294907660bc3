"""``mlp``: a Linear -> activation stack classifying synthetic tabular data from a fixed teacher.

Features are standard normal; the label is the argmax of a fixed random two-layer tanh
"teacher" network (the same in every process), so the task is learnable but not linear.
Only the features drawn depend on the batch seed.

>>> from turbotrain.workloads import get_workload
>>> wl = get_workload("mlp", B=4, in_dim=8, hidden=16)
>>> x, y = next(wl.batches())
>>> wl.build_model()(x).shape
torch.Size([4, 16])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..errors import check_choice, check_positive
from .base import Workload, cross_entropy_loss
from .data import seeded_build, synthetic_batches

__all__ = ["MLPSettings", "build_mlp", "Teacher", "make_workload", "ACTIVATIONS"]

TASK_SEED = 4321
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


@dataclass(frozen=True)
class MLPSettings:
    """Model, data and batch shape of the mlp workload."""

    B: int = 256
    """Samples per batch."""
    in_dim: int = 256
    """Input features."""
    hidden: int = 1024
    """Width of every hidden layer."""
    n_layer: int = 4
    """Hidden Linear->activation pairs before the classifier Linear."""
    num_classes: int = 16
    """Output classes."""
    act: str = "gelu"
    """'gelu' or 'relu'."""
    init_seed: int = 0
    """Seed of the weight initialisation (independent of the global RNG)."""

    def __post_init__(self):
        for name in ("B", "in_dim", "hidden", "n_layer", "num_classes"):
            check_positive(name, getattr(self, name))
        check_positive("init_seed", self.init_seed, allow_zero=True)
        check_choice("act", self.act, tuple(ACTIVATIONS))


def build_mlp(s: MLPSettings) -> nn.Sequential:
    """Sequential(Linear, act, ..., Linear): flat, so the linear_act fusion sees each pair."""
    layers, width = [], s.in_dim
    for _ in range(s.n_layer):
        layers += [nn.Linear(width, s.hidden), ACTIVATIONS[s.act]()]
        width = s.hidden
    layers.append(nn.Linear(width, s.num_classes))
    return nn.Sequential(*layers)


class Teacher:
    """The labelling function: argmax of tanh(x W1) W2, weights fixed by TASK_SEED."""

    def __init__(self, in_dim: int, num_classes: int, hidden: int = 64):
        g = torch.Generator().manual_seed(TASK_SEED)
        # 1/sqrt(fan_in) scaling keeps tanh in its non-linear but unsaturated range.
        self.w1 = torch.randn(in_dim, hidden, generator=g) / in_dim**0.5
        self.w2 = torch.randn(hidden, num_classes, generator=g) / hidden**0.5

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=-1)


def _tabular_stream(s: MLPSettings, generator: torch.Generator, device):
    teacher = Teacher(s.in_dim, s.num_classes)
    while True:
        x = torch.randn(s.B, s.in_dim, generator=generator)
        yield x.to(device), teacher(x).to(device)


def make_workload(settings: MLPSettings | None = None) -> Workload:
    """The mlp Workload; ``get_workload('mlp', **overrides)`` validates overrides first."""
    s = settings or MLPSettings()

    return Workload(
        name="mlp",
        kind="tabular",
        unit="samples",
        items_per_batch=s.B,
        build_model=seeded_build(lambda: build_mlp(s), s.init_seed),
        loss_fn=cross_entropy_loss,
        batches=synthetic_batches(lambda generator, device: _tabular_stream(s, generator, device)),
        description=f"MLP {s.n_layer}x{s.hidden} {s.act} on {s.in_dim}-feature synthetic data "
        f"({s.num_classes} classes, fixed teacher)",
        settings=asdict(s),
    )
