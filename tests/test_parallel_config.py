"""ParallelConfig, its place in Config, and the checks that fail before any rank talks to another."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.distributed as dist
from torch import nn

from turbotrain import Config, ConfigError, DataParallelConfig
from turbotrain.parallel import ParallelConfig, ParallelTransform, ResolvedDegrees, find_layout
from turbotrain.parallel.tp_plans import check_model


def test_defaults_shard_over_every_rank():
    cfg = ParallelConfig()
    assert (cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.sequence_parallel, cfg.reshard_after_forward) == \
        (1, -1, 1, False, True)
    assert cfg.resolve(8) == ResolvedDegrees(1, 8, 1)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"dp_replicate": 0}, "dp_replicate=0 is not valid; it must be an integer >= 1"),
    ({"dp_shard": 0}, "or -1 (the ranks left over)"),
    ({"dp_shard": -2}, "dp_shard=-2"),
    ({"tp": 1.5}, "tp=1.5"),
    ({"tp": True}, "tp=True"),
    ({"sequence_parallel": True}, "needs tp > 1"),
    ({"tp": 2, "sequence_parallel": "yes"}, "True or False"),
    ({"reshard_after_forward": 1}, "True or False"),
])
def test_invalid_values_say_what_is_valid(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize("kwargs, world, want", [
    ({"tp": 2}, 8, (1, 4, 2)),
    ({"dp_replicate": 2, "tp": 2}, 8, (2, 2, 2)),
    ({"dp_replicate": 2, "dp_shard": 2}, 4, (2, 2, 1)),
    ({"dp_shard": 1, "tp": 4}, 4, (1, 1, 4)),
    ({}, 1, (1, 1, 1)),
])
def test_resolve_fills_in_the_ranks_left_over(kwargs, world, want):
    got = ParallelConfig(**kwargs).resolve(world)
    assert (got.dp_replicate, got.dp_shard, got.tp) == want and got.world_size == world
    assert got.dp == want[0] * want[1]


def test_resolve_names_the_numbers_when_the_product_is_not_the_world():
    with pytest.raises(ConfigError) as info:
        ParallelConfig(dp_shard=3).resolve(4)
    assert "dp_replicate=1 x dp_shard=3 x tp=1 = 3 ranks" in str(info.value) and "world size is 4" in str(info.value)
    with pytest.raises(ConfigError, match="tp=3 = 3 does not divide the world size 4"):
        ParallelConfig(tp=3).resolve(4)


def test_config_takes_parallel_and_round_trips_it():
    assert Config(parallel=True).parallel == ParallelConfig()
    assert Config(parallel=False).parallel is None and Config().parallel is None
    cfg = Config(parallel=ParallelConfig(dp_replicate=2, tp=2, sequence_parallel=True, reshard_after_forward=False))
    d = cfg.to_dict()
    assert d["parallel"] == {"dp_replicate": 2, "dp_shard": -1, "cp": 1, "tp": 2, "sequence_parallel": True,
                             "loss_parallel": True, "reshard_after_forward": False}
    assert Config.from_dict(d) == cfg
    import json

    assert Config.from_json(json.dumps(d)) == cfg
    assert Config.from_dict(Config(parallel=True).to_dict()).parallel == ParallelConfig()


def test_config_refuses_bad_parallel_settings():
    with pytest.raises(ConfigError, match="ParallelConfig"):
        Config(parallel="fsdp")
    with pytest.raises(ConfigError, match="unknown parallel setting.*'pp'.*dp_replicate"):
        Config.from_dict({"parallel": {"pp": 2}})  # pipeline parallel: no such degree
    with pytest.raises(ConfigError, match="needs tp > 1"):
        Config.from_dict({"parallel": {"sequence_parallel": True}})


@pytest.mark.parametrize("dp", [True, DataParallelConfig(compression="bf16")])
def test_data_parallel_and_parallel_together_is_refused(dp):
    with pytest.raises(ConfigError, match="data_parallel and parallel were both given; choose one"):
        Config(data_parallel=dp, parallel=ParallelConfig())


def test_a_product_that_misses_the_world_fails_before_any_collective(monkeypatch):
    for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
                "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    # No rank 1..3 exists: a collective (or even the rendezvous) would hang, so the error must come first.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ConfigError, match="= 3 ranks, but the world size is 4"):
        ParallelTransform(ParallelConfig(dp_shard=3)).place(torch.device("cpu"))
    assert not dist.is_initialized()


def test_transform_needs_a_parallel_config():
    with pytest.raises(ConfigError, match="ParallelConfig"):
        ParallelTransform({"tp": 2})


# -- tensor-parallel plans: what they refuse, before any collective --------------------------
def _gpt(**kw):
    from turbotrain.workloads import get_workload

    return get_workload("gpt", **{"d": 64, "n_layer": 2, "n_head": 4, "T": 32, "B": 2, "vocab_size": 512,
                                  **kw}).build_model()


def test_a_model_without_a_plan_names_the_supported_ones():
    with pytest.raises(ConfigError) as info:
        find_layout(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    msg = str(info.value)
    for family in ("turbotrain gpt", "turbotrain llama", "Hugging Face Llama"):
        assert family in msg
    assert "tp=1" in msg and "register_layout" in msg


def test_layouts_are_found_by_model():
    from turbotrain.workloads import get_workload

    assert find_layout(_gpt()).family == "turbotrain gpt"
    llama = get_workload("llama", d=64, n_layer=2, n_head=4, T=32, B=2, vocab_size=512).build_model()
    assert find_layout(llama).family == "turbotrain llama"
    from hf_models import build

    assert find_layout(build("llama")).family.startswith("Hugging Face Llama")


def test_tp_must_divide_the_heads():
    model = _gpt()
    with pytest.raises(ConfigError, match=r"tp=3 must divide the model's attention heads \(4\); choose tp among"):
        check_model(model, find_layout(model), 3)
    check_model(model, find_layout(model), 2)


def test_a_fused_projection_is_refused_with_the_fix():
    model = _gpt()
    model.blocks[1].attn.q_proj = nn.Identity()  # where the qkv fusion leaves a slice of its fused weight
    with pytest.raises(ConfigError, match="expected a Linear at attn.q_proj .* found Identity.*leave those patterns out"):
        check_model(model, find_layout(model), 2)


def test_a_tied_head_is_refused():
    from hf_models import build

    model = build("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="tied to the embedding"):
        check_model(model, find_layout(model), 2)


@pytest.mark.parametrize("module", ["config", "checkpoint", "clipping"])
def test_docstring_examples_run(module):
    import importlib

    mod = importlib.import_module(f"turbotrain.parallel.{module}")
    assert doctest.testmod(mod).failed == 0
