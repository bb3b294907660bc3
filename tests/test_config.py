import pytest

from turbotrain import Config, ConfigError, DataParallelConfig, LossScaleConfig


def test_defaults_are_plain_fp32():
    cfg = Config()
    assert cfg.precision == "fp32" and cfg.accumulate == 1 and cfg.fuse == () and cfg.data_parallel is None


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"precision": "bf32"}, "'bf16-master'"),
        ({"checkpoint": "all"}, "'blocks'"),
        ({"device": "tpu"}, "'cuda'"),
        ({"accumulate": 0}, "integer >= 1"),
        ({"clip_grad_norm": -1.0}, "> 0"),
        ({"fuse": ("qkv", "magic")}, "'linear_cross_entropy'"),
        ({"seq_buckets": (0, 64)}, "positive"),
    ],
)
def test_invalid_values_name_the_valid_choices(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        Config(**kwargs)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_fuse_and_data_parallel_are_normalised():
    cfg = Config(fuse=True, data_parallel=True, seq_buckets=(128, 64, 128))
    assert "qkv" in cfg.fuse and isinstance(cfg.data_parallel, DataParallelConfig)
    assert cfg.seq_buckets == (64, 128)
    assert Config(fuse="qkv").fuse == ("qkv",)


def test_loss_scale_bounds_validated():
    with pytest.raises(ConfigError, match="min_scale <= init_scale <= max_scale"):
        LossScaleConfig(init_scale=2.0**30)
    with pytest.raises(ConfigError, match="backoff_factor"):
        LossScaleConfig(backoff_factor=1.5)
    with pytest.raises(ConfigError, match="compression"):
        DataParallelConfig(compression="zip")


def test_config_is_frozen_and_replace_revalidates():
    cfg = Config()
    with pytest.raises(Exception):
        cfg.precision = "bf16-master"
    assert cfg.replace(precision="bf16-master").precision == "bf16-master"
    with pytest.raises(ConfigError):
        cfg.replace(accumulate=-2)


def test_to_dict_is_plain():
    d = Config(precision="fp16-master", fuse=("qkv",)).to_dict()
    assert d["fuse"] == ["qkv"] and d["loss_scale"]["init_scale"] == 2.0**16
