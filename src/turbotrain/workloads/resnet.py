"""``resnet``: a scaled-down ResNet-50 (bottleneck blocks) on synthetic, learnable images.

The block is ResNet-50's: 1x1 reduce, 3x3, 1x1 expand (x4), each conv followed by BatchNorm,
ReLU after the residual add, and a 1x1 projection shortcut where shape changes. The default
scales it down (base width 16 instead of 64, one or two blocks per stage instead of 3/4/6/3,
64x64 inputs) so one step on 2 CPU cores stays well under a second.

Images are a fixed per-class pattern (smooth random colour fields, the same in every process)
plus Gaussian noise; a model has to learn the patterns to beat chance, so the loss carries a
real signal. Only the noise and the labels depend on the batch seed.

>>> from turbotrain.workloads import get_workload
>>> wl = get_workload("resnet", B=2)
>>> x, y = next(wl.batches())
>>> wl.build_model()(x).shape
torch.Size([2, 10])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, check_positive
from .base import Workload, cross_entropy_loss
from .data import seeded_build, synthetic_batches

__all__ = ["ResNetSettings", "Bottleneck", "ResNet", "class_patterns", "make_workload"]

#: Seeds the class patterns: the task is the same whatever the batch seed.
TASK_SEED = 1234


@dataclass(frozen=True)
class ResNetSettings:
    """Model, data and batch shape of the resnet workload."""

    B: int = 32
    """Images per batch."""
    image_size: int = 64
    """Height and width of the square RGB inputs."""
    num_classes: int = 10
    """Classes, one pattern each."""
    width: int = 16
    """Bottleneck width of the first stage (ResNet-50: 64); doubles every stage."""
    layers: tuple[int, ...] = (1, 2, 2, 1)
    """Bottleneck blocks per stage (ResNet-50: 3, 4, 6, 3); stages after the first stride by 2."""
    noise: float = 1.0
    """Std of the per-pixel Gaussian noise; the patterns have unit std, so SNR 1 per pixel."""
    init_seed: int = 0
    """Seed of the weight initialisation (independent of the global RNG)."""

    def __post_init__(self):
        for name in ("B", "image_size", "num_classes", "width", "noise"):
            check_positive(name, getattr(self, name))
        check_positive("init_seed", self.init_seed, allow_zero=True)
        layers = tuple(self.layers) if isinstance(self.layers, (tuple, list)) else None
        if not layers or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in layers):
            raise ConfigError(f"layers={self.layers!r} is not valid; give blocks per stage, e.g. (1, 2, 2, 1)")
        object.__setattr__(self, "layers", layers)
        if self.image_size < 2 ** (len(layers) + 1):
            raise ConfigError(
                f"image_size={self.image_size} is too small for {len(layers)} stages; "
                f"use at least {2 ** (len(layers) + 1)}"
            )


class Bottleneck(nn.Module):
    """ResNet-50 bottleneck (stride on the 3x3, as in torchvision's 'ResNet v1.5')."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        # Zero-init the last BN scale so each block starts as the identity (Goyal et al. 2017):
        # a deep net then trains from step one without warm-up.
        nn.init.zeros_(self.bn3.weight)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """``stem`` (3x3 conv, BN, ReLU, stride 2), flat ``blocks``, global average pool, ``fc``."""

    def __init__(self, s: ResNetSettings):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, s.width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(s.width), nn.ReLU(inplace=True)
        )
        blocks, c_in = [], s.width
        for stage, n_blocks in enumerate(s.layers):
            width = s.width * 2**stage
            for i in range(n_blocks):
                blocks.append(Bottleneck(c_in, width, stride=2 if stage > 0 and i == 0 else 1))
                c_in = width * Bottleneck.expansion
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(c_in, s.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def class_patterns(num_classes: int, image_size: int) -> torch.Tensor:
    """(num_classes, 3, S, S) smooth colour fields with zero mean and unit std, fixed by TASK_SEED."""
    g = torch.Generator().manual_seed(TASK_SEED)
    coarse = torch.randn(num_classes, 3, 8, 8, generator=g)
    fields = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
    fields = fields - fields.mean(dim=(1, 2, 3), keepdim=True)
    return fields / fields.std(dim=(1, 2, 3), keepdim=True)


def _image_stream(s: ResNetSettings, generator: torch.Generator, device):
    patterns = class_patterns(s.num_classes, s.image_size)
    while True:
        labels = torch.randint(0, s.num_classes, (s.B,), generator=generator)
        noise = torch.randn(s.B, 3, s.image_size, s.image_size, generator=generator)
        yield (patterns[labels] + s.noise * noise).to(device), labels.to(device)


def make_workload(settings: ResNetSettings | None = None) -> Workload:
    """The resnet Workload; ``get_workload('resnet', **overrides)`` validates overrides first."""
    s = settings or ResNetSettings()

    return Workload(
        name="resnet",
        kind="image",
        unit="samples",
        items_per_batch=s.B,
        build_model=seeded_build(lambda: ResNet(s), s.init_seed),
        loss_fn=cross_entropy_loss,
        batches=synthetic_batches(lambda generator, device: _image_stream(s, generator, device)),
        description=f"ResNet-50-style bottlenecks, width {s.width}, layers {s.layers}, "
        f"{s.image_size}px synthetic {s.num_classes}-class images",
        settings=asdict(s),
    )
