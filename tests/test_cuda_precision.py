"""CUDA paths of the precision modes; run by scripts/gpu-check.sh on a GPU, skipped elsewhere."""

import math

import pytest
import torch
from torch import nn

from turbotrain import Config, Engine, LossScaleConfig
from turbotrain.workloads import get_workload

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check.sh)"),
]


def _train(precision, steps=60, **config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    engine = Engine(model, opt, nn.functional.cross_entropy,
                    config=Config(device="cuda", precision=precision, **config))
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


def _scales_and_skips(engine, batches, steps):
    scales, skipped, losses = [], [], []
    for _ in range(steps):
        stats = engine.step(next(batches))
        scales.append(stats.loss_scale)
        skipped.append(bool(stats.skipped))
        losses.append(float(stats.loss))
    return scales, skipped, losses


def check_scaler_contract(scales, skipped, init, interval):
    """The dynamic scale grows only after ``interval`` clean steps and falls only on a skipped step."""
    previous, clean = init, 0
    for step, (scale, skip) in enumerate(zip(scales, skipped)):
        clean = 0 if skip else clean + 1
        if scale > previous:
            assert clean % interval == 0 and not skip, f"step {step}: grew to {scale} after {clean} clean steps"
        if scale < previous:
            assert skip, f"step {step}: the scale fell to {scale} on a step that was not skipped"
        previous = scale
    assert max(scales) > init, f"the scale never grew from {init} in {len(scales)} steps: {scales}"
    assert sum(skipped) < len(skipped) // 4, f"{sum(skipped)} of {len(skipped)} steps skipped"


def test_fp16_scaler_grows_and_backs_off_on_cuda():
    engine, _ = _train("fp16-master", steps=0, loss_scale=LossScaleConfig(growth_interval=5))
    g = torch.Generator(device="cuda").manual_seed(1)
    teacher = torch.randn(64, 16, device="cuda", generator=g)

    def batches():
        while True:
            x = torch.randn(128, 64, device="cuda", generator=g)
            yield x, (x @ teacher).argmax(-1)

    scales, skipped, losses = _scales_and_skips(engine, batches(), 60)
    check_scaler_contract(scales, skipped, 2.0**16, 5)
    assert math.isfinite(losses[-1]) and losses[-1] < 0.5 * losses[0]


def _gpt_run(fuse, steps=50):
    workload = get_workload("gpt", d=128, n_layer=2, n_head=4, T=64, B=8)  # vocab 8192: two softmax blocks
    torch.manual_seed(0)
    model = workload.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = Config(device="cuda", precision="fp16-master", fuse=fuse,
                    loss_scale=LossScaleConfig(growth_interval=5))
    engine = Engine(model, opt, workload.loss_fn, config=config)
    return _scales_and_skips(engine, workload.batches(split="train", seed=0, device="cuda"), steps)


def test_fp16_master_fused_cross_entropy_lets_the_scale_grow_past_2_16():
    # The fused head used to multiply fp16 gradients by the loss scale cast to fp16: at 2**16
    # (inf in fp16) every step overflowed, so the scale could never pass 2**16.
    scales, skipped, losses = _gpt_run(("linear_cross_entropy",))
    assert all(math.isfinite(v) for v in losses)
    check_scaler_contract(scales, skipped, 2.0**16, 5)
    assert sum(losses[-10:]) / 10 < losses[0]
    _, _, stock = _gpt_run(())
    # same seeds and batches; skipped steps may differ, so the curves agree loosely
    assert abs(sum(losses[-10:]) - sum(stock[-10:])) / sum(stock[-10:]) < 0.05


def test_fp16_overflow_is_skipped_on_cuda():
    engine, _ = _train("fp16-master", steps=1)
    handle = engine.module[3].register_full_backward_hook(
        lambda m, gi, go: tuple(torch.full_like(g, float("inf")) if g is not None else None for g in gi))
    x = torch.randn(8, 64, device="cuda")
    stats = engine.step((x, torch.zeros(8, dtype=torch.long, device="cuda")))
    handle.remove()
    assert stats.skipped and stats.loss_scale == 2.0**15
