"""CUDA paths of the precision modes; run by scripts/gpu-check.sh on a GPU, skipped elsewhere."""

import pytest
import torch
from torch import nn

from turbotrain import Config, Engine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check.sh)"),
]


def _train(precision, steps=60):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    engine = Engine(model, opt, nn.functional.cross_entropy, config=Config(device="cuda", precision=precision))
    g = torch.Generator(device="cuda").manual_seed(1)
    teacher = torch.randn(64, 16, device="cuda", generator=g)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 64, device="cuda", generator=g)
        stats = engine.step((x, (x @ teacher).argmax(-1)))
        losses.append(float(stats.loss))
    return engine, losses


@pytest.mark.parametrize("precision", ["bf16-master", "fp16-master", "bf16-mixed", "fp16-mixed"])
def test_low_precision_tracks_fp32_on_cuda(precision):
    _, ref = _train("fp32")
    engine, got = _train(precision)
    assert got[-1] < 0.5 * got[0]
    assert abs(sum(got[-10:]) - sum(ref[-10:])) / sum(ref[-10:]) < 0.1
    if precision == "fp16-master":
        assert engine.precision.scaler.scale >= engine.config.loss_scale.min_scale


def test_fp16_overflow_is_skipped_on_cuda():
    engine, _ = _train("fp16-master", steps=1)
    handle = engine.module[3].register_full_backward_hook(
        lambda m, gi, go: tuple(torch.full_like(g, float("inf")) if g is not None else None for g in gi))
    x = torch.randn(8, 64, device="cuda")
    stats = engine.step((x, torch.zeros(8, dtype=torch.long, device="cuda")))
    handle.remove()
    assert stats.skipped and stats.loss_scale == 2.0**15
