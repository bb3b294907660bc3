import json
import torch

import pytest

from turbotrain import Config, ConfigError, DataParallelConfig, LossScaleConfig
from turbotrain.config import FUSION_PATTERNS


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
    assert cfg.fuse is True and isinstance(cfg.data_parallel, DataParallelConfig)
    assert cfg.seq_buckets == (64, 128)
    assert Config(fuse="qkv").fuse == ("qkv",)
    assert Config(fuse="all").fuse == FUSION_PATTERNS
    assert Config(fuse=False).fuse == () and Config(fuse=None).fuse == ()
    assert Config.from_dict(Config(fuse=True).to_dict()).fuse is True


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


TRUE_OR_FALSE = "True or False"


@pytest.mark.parametrize(
    "cls, kwargs, fix",
    [
        # numbers given as strings, bools or None: the old checks compared them and raised TypeError
        (Config, {"clip_grad_norm": "1.0"}, "a number > 0"),
        (LossScaleConfig, {"init_scale": "big"}, "a number > 0"),
        (LossScaleConfig, {"min_scale": None}, "a number > 0"),
        (LossScaleConfig, {"max_scale": "inf"}, "a number > 0"),
        (LossScaleConfig, {"growth_factor": "2"}, "a number > 1"),
        (LossScaleConfig, {"backoff_factor": "0.5"}, "a number > 0 and < 1"),
        (LossScaleConfig, {"backoff_factor": None}, "a number > 0 and < 1"),
        (DataParallelConfig, {"bucket_mb": "25"}, "a number > 0"),
        (DataParallelConfig, {"bucket_mb": None}, "a number > 0"),
        # containers that are not tuples: the old code iterated them
        (Config, {"fuse": 1}, "'linear_cross_entropy'"),
        (Config, {"fuse": 0}, "'linear_cross_entropy'"),
        (Config, {"fuse": {"qkv": 1}}, "'linear_cross_entropy'"),
        (Config, {"seq_buckets": 64}, "tuple of positive integers"),
        (Config, {"seq_buckets": (64, "128")}, "positive integer"),
        (Config, {"seq_buckets": (64, True)}, "positive integer"),
        # flags that are not real bools: "no" used to switch the flag on
        (Config, {"nan_check": "no"}, TRUE_OR_FALSE),
        (Config, {"keep_fp32_head": 1}, TRUE_OR_FALSE),
        (Config, {"compile": "yes"}, TRUE_OR_FALSE),
        (Config, {"attention": "flash"}, "'plain'"),
        (Config, {"attention": "plain"}, "compile=True"),  # plain attention lives in the compiled graph
        (Config, {"sync_stats": None}, TRUE_OR_FALSE),
        (Config, {"track_grad_norm": 0}, TRUE_OR_FALSE),
        (DataParallelConfig, {"sync_bn": "no"}, TRUE_OR_FALSE),
        (DataParallelConfig, {"sparse_embeddings": 1}, TRUE_OR_FALSE),
        (DataParallelConfig, {"find_unused_parameters": "False"}, TRUE_OR_FALSE),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_wrong_types_raise_config_error_naming_field_value_and_fix(cls, kwargs, fix):
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    message = str(info.value)
    (name, value), = kwargs.items()
    assert f"{name}={value!r}" in message
    assert fix in message
    assert "\n" not in message


def test_plain_attention_with_checkpointing_is_refused_and_auto_leaves_it_to_the_stock_kernel():
    with pytest.raises(ConfigError, match="attention='plain' with checkpoint='blocks'.*attention='auto'"):
        Config(attention="plain", compile=True, checkpoint="blocks")
    from turbotrain.engine import build_transforms

    for checkpoint, auto in ((None, None), ("blocks", False)):
        config = Config(compile=True, checkpoint=checkpoint, device="cpu")
        (compile_t,) = [t for t in build_transforms(config, torch.device("cpu")) if t.name == "compile"]
        assert compile_t.attention is auto  # None: chosen at set-up (plain on a CPU in bf16)


def test_from_dict_and_from_json_invert_to_dict():
    cfg = Config(
        precision="fp16-master", loss_scale=LossScaleConfig(init_scale=2.0**12, hysteresis=2),
        keep_fp32_head=True, accumulate=4, clip_grad_norm=1.0, fuse=("qkv", "swiglu"), seq_buckets=(256, 128),
        checkpoint="blocks", data_parallel=DataParallelConfig(compression="powersgd", sync_bn=True),
        nan_check=True, device="cpu", track_grad_norm=True,
    )
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert Config.from_json(json.dumps(cfg.to_dict())) == cfg
    assert Config.from_dict(Config(data_parallel=True).to_dict()).data_parallel == DataParallelConfig()
    assert Config.from_dict({}) == Config()


@pytest.mark.parametrize(
    "build, fragments",
    [
        (lambda: Config.from_dict({"acumulate": 4}), ["'acumulate'", "accumulate"]),
        (lambda: Config.from_dict({"loss_scale": {"init": 1.0}}), ["loss_scale", "'init'", "init_scale"]),
        (lambda: Config.from_dict({"data_parallel": {"rank": 2}}), ["data_parallel", "'rank'", "powersgd_rank"]),
        (lambda: Config.from_dict(["fp32"]), ["dict"]),
        (lambda: Config.from_json("precision: fp32"), ["JSON object"]),
        (lambda: Config.from_json('{"nan_check": "no"}'), ["nan_check='no'", TRUE_OR_FALSE]),
    ],
)
def test_from_dict_names_unknown_keys_and_bad_input(build, fragments):
    with pytest.raises(ConfigError) as info:
        build()
    assert all(f in str(info.value) for f in fragments), str(info.value)
