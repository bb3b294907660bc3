import pytest
import torch

from turbotrain import LossScaleConfig, LossScaleError
from turbotrain.precision import DynamicLossScaler, unscale_and_check_


def test_defaults_match_the_documented_range():
    s = DynamicLossScaler()
    assert s.scale == 2.0**16
    assert (s.config.min_scale, s.config.max_scale) == (2.0**10, 2.0**24)
    assert (s.config.growth_factor, s.config.backoff_factor, s.config.growth_interval) == (2.0, 0.5, 2000)


def test_overflow_skips_and_backs_off():
    s = DynamicLossScaler(LossScaleConfig(init_scale=2.0**16))
    assert s.update(found_inf=True) is True
    assert s.scale == 2.0**15 and s.overflows == 1


def test_growth_after_interval_only():
    s = DynamicLossScaler(LossScaleConfig(init_scale=2.0**12, growth_interval=3))
    for _ in range(2):
        assert s.update(found_inf=False) is False
    assert s.scale == 2.0**12
    s.update(found_inf=False)
    assert s.scale == 2.0**13
    # an overflow resets the clean-step count
    s.update(found_inf=False), s.update(found_inf=False), s.update(found_inf=True)
    s.update(found_inf=False), s.update(found_inf=False)
    assert s.scale == 2.0**12


def test_bounds_are_respected():
    cfg = LossScaleConfig(init_scale=2.0**11, min_scale=2.0**10, max_scale=2.0**12, growth_interval=1,
                          max_floor_overflows=100)
    s = DynamicLossScaler(cfg)
    for _ in range(5):
        s.update(found_inf=False)
    assert s.scale == 2.0**12
    for _ in range(5):
        s.update(found_inf=True)
    assert s.scale == 2.0**10


def test_hysteresis_tolerates_overflows_before_backing_off():
    s = DynamicLossScaler(LossScaleConfig(init_scale=2.0**16, hysteresis=3))
    seq = []
    for _ in range(4):
        skipped = s.update(found_inf=True)
        seq.append((skipped, s.scale))
    # every overflowing step is skipped; the scale halves only on the 3rd, then the count restarts
    assert seq == [(True, 2.0**16), (True, 2.0**16), (True, 2.0**15), (True, 2.0**15)]


def test_pinned_at_floor_raises_with_pointer_to_nan_finder():
    s = DynamicLossScaler(LossScaleConfig(init_scale=2.0**10, max_floor_overflows=3))
    s.update(True), s.update(True)
    with pytest.raises(LossScaleError, match="find_nonfinite"):
        s.update(True)


def test_state_dict_round_trip():
    s = DynamicLossScaler(LossScaleConfig(hysteresis=2, growth_interval=5))
    for flag in (True, False, False, True, True, False):
        s.update(flag)
    t = DynamicLossScaler(LossScaleConfig(hysteresis=2, growth_interval=5))
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    for flag in (False, True, False, False, False, False, False):
        assert s.update(flag) == t.update(flag)
    assert s.scale == t.scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_and_check_is_one_flag_for_all_tensors(dtype):
    grads = [torch.full((3,), 8.0, dtype=dtype), torch.full((2, 2), 4.0, dtype=dtype)]
    flag = unscale_and_check_(grads, 0.25)
    assert float(flag) == 0.0 and grads[0][0].item() == 2.0 and grads[1][0, 0].item() == 1.0
    grads.append(torch.tensor([1.0, float("inf")], dtype=dtype))
    assert float(unscale_and_check_(grads, 1.0)) == 1.0
    assert float(unscale_and_check_([torch.tensor([float("nan")])], 1.0)) == 1.0
