"""Single-process tests of turbotrain.comm: launcher variables, NCCL presets, packing, twins."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from turbotrain.comm import DataParallelConfig, OneBitAdam, convert_batchnorm, read_launch_env, to_onebit_adam
from turbotrain.comm.bench import bus_factor, parse_size, size_sweep
from turbotrain.comm.nccl import apply_preset, format_env, preset_env, validate_nccl_env
from turbotrain.comm.onebit import OneBitCompressor, pack_signs, unpack_signs
from turbotrain.comm.powersgd import should_compress
from turbotrain.comm.preflight import _differences, plan_hash
from turbotrain.comm.reference import reference_onebit_mean
from turbotrain.errors import ConfigError, DistributedError

MASTER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


# -- launcher variables ---------------------------------------------------------------------------
@pytest.mark.parametrize("env, launcher", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, "torchrun"),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "mpi"),
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}, "pmi"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}, "slurm"),
])
def test_each_launcher_is_read(env, launcher):
    got = read_launch_env({**env, **MASTER})
    assert (got.launcher, got.rank, got.world_size, got.local_rank, got.master_port) == (launcher, 3, 4, 1, 29500)


@pytest.mark.parametrize("env, named", [
    ({"RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "outside 0..1"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0", "SLURM_LOCALID": "0"}, "SLURM_NTASKS=0"),
])
def test_bad_or_missing_variable_is_named(env, named):
    with pytest.raises(DistributedError, match=named.replace("(", r"\(").replace(".", r"\.")):
        read_launch_env({**env, **MASTER})


def test_missing_master_addr_and_port_say_what_to_export():
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    with pytest.raises(DistributedError, match="export MASTER_ADDR"):
        read_launch_env(env)
    with pytest.raises(DistributedError, match="export MASTER_PORT"):
        read_launch_env({**env, "MASTER_ADDR": "127.0.0.1"})
    with pytest.raises(DistributedError, match="turbotrain launch"):
        read_launch_env({})


# -- NCCL presets ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["default", "ib", "ethernet", "single-node"])
def test_presets_are_valid(name):
    validate_nccl_env(preset_env(name))


@pytest.mark.parametrize("env, message", [
    ({"NCCL_NSOCKS_PERTHREAD": "8", "NCCL_SOCKET_NTHREADS": "16"}, "at most 64"),
    ({"NCCL_ALGO": "Ring,Fast"}, "'Fast' is not an NCCL algorithm"),
    ({"NCCL_BUFFSIZE": "4MB"}, "must be an integer"),
    ({"NCCL_BUFFSIZE": "1024"}, "out of range"),
    ({"NCCL_IB_DISABLE": "yes"}, "must be 0 or 1"),
    ({"NCCL_NET_GDR_LEVEL": "FAR"}, "PHB"),
])
def test_bad_nccl_values_are_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        validate_nccl_env(env)


def test_nccl_algo_accepts_lists_negation_and_per_collective_form():
    validate_nccl_env({"NCCL_ALGO": "^Tree"})
    validate_nccl_env({"NCCL_ALGO": "ring,tree"})
    validate_nccl_env({"NCCL_ALGO": "allreduce:tree"})


def test_preset_respects_user_env_and_overrides_win():
    environ = {"NCCL_SOCKET_NTHREADS": "2"}
    chosen = apply_preset("ethernet", {"NCCL_BUFFSIZE": "4194304"}, environ=environ)
    assert chosen["NCCL_SOCKET_NTHREADS"] == ("2", "environment")
    assert environ["NCCL_BUFFSIZE"] == "4194304" and chosen["NCCL_BUFFSIZE"][1] == "override"
    assert environ["NCCL_ALGO"] == "Ring"
    assert "NCCL_NET_GDR_LEVEL unset" in format_env(chosen)
    with pytest.raises(ConfigError, match="at most 64"):  # the merged result is what gets checked
        apply_preset("ethernet", {"NCCL_NSOCKS_PERTHREAD": "32"}, environ={})
    with pytest.raises(ConfigError, match="unknown"):
        apply_preset("infiniband", environ={})


def test_default_preset_prints_nccls_real_buffsize_default():
    assert "4194304" in format_env(apply_preset("default", environ={}))


# -- comm-bench conventions --------------------------------------------------------------------
@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 8, 1.75), ("all_gather", 4, 0.75),
    ("reduce_scatter", 8, 0.875), ("broadcast", 8, 1.0),
])
def test_bus_factors_are_nccl_tests(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def test_sizes():
    assert parse_size("4K") == 4096 and parse_size("1M") == 1 << 20 and parse_size("64") == 64
    assert size_sweep(1024, 16384, 4) == [1024, 4096, 16384]


# -- compression pieces ---------------------------------------------------------------------
def test_sign_packing_round_trips():
    x = torch.randn(8 * 13)
    x[5] = 0.0  # sign(0) is sent as +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 13
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


def test_single_process_onebit_exchange_is_the_twin_with_one_rank():
    comp = OneBitCompressor()
    x = torch.randn(37)
    werr, serr = [torch.zeros(37)], [torch.zeros(40)]
    for _ in range(3):
        torch.testing.assert_close(comp.exchange(x, [20, 17]), reference_onebit_mean([x], [20, 17], werr, serr))
    torch.testing.assert_close(comp.worker_error, werr[0])


def test_onebit_adam_is_adam_during_warmup():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(5, 3))
    b = nn.Parameter(a.detach().clone())
    ours = OneBitAdam([a], lr=0.01, warmup_steps=5)
    ref = torch.optim.Adam([b], lr=0.01)
    for _ in range(5):
        g = torch.randn(5, 3)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    # Same formula, fp32: a few ulps from the different order of the bias corrections.
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert ours.compressing


def test_onebit_conversion_keeps_hyperparameters_and_refuses_others():
    p = nn.Parameter(torch.zeros(3))
    conv = to_onebit_adam(torch.optim.AdamW([p], lr=0.02, betas=(0.8, 0.99), weight_decay=0.1), warmup_steps=3)
    assert isinstance(conv, OneBitAdam) and conv.param_groups[0]["lr"] == 0.02
    assert conv.param_groups[0]["betas"] == (0.8, 0.99) and conv.warmup_steps == 3
    with pytest.raises(ConfigError, match="needs an Adam"):
        to_onebit_adam(torch.optim.SGD([p], lr=0.1), 3)
    with pytest.raises(ConfigError, match="AdamW"):
        to_onebit_adam(torch.optim.Adam([p], weight_decay=0.1), 3)
    with pytest.raises(ConfigError, match="warmup_steps"):
        OneBitAdam([p], warmup_steps=0)


def test_powersgd_compresses_only_matrices_it_shrinks():
    assert should_compress(torch.Size([64, 48]), 4)
    assert not should_compress(torch.Size([48]), 4)  # biases go exact
    assert not should_compress(torch.Size([4, 4]), 4)  # factors as big as the matrix
    assert should_compress(torch.Size([16, 8, 3, 3]), 4)  # conv kernel as 16 x 72


def test_sync_bn_conversion_only_when_asked():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    weight = model[1].weight
    assert convert_batchnorm(model, DataParallelConfig()) is model
    converted = convert_batchnorm(model, DataParallelConfig(sync_bn=True))
    assert isinstance(converted[1], nn.SyncBatchNorm) and converted[1].weight is weight  # optimizer stays valid


def test_plan_hash_and_differences():
    a = {"compression": None, "params": [["w", [2, 2]]]}
    b = {"compression": "bf16", "params": [["w", [2, 3]]]}
    assert plan_hash(a) == plan_hash(dict(a)) != plan_hash(b)
    diff = _differences(b, a)
    assert "compression ('bf16' vs None)" in diff and any(d.startswith("params") for d in diff)


def test_powersgd_state_dict_does_not_alias_the_in_place_error_buffers():
    # the hook updates its error buffers in place; a saved (or loaded) state must not move with them
    from turbotrain.comm.powersgd import PowerSGDState

    state = PowerSGDState(rank=2)
    state.errors["w"] = torch.zeros(4, 3)
    saved = state.state_dict()
    state.errors["w"].add_(1.0)
    assert torch.equal(saved["errors"]["w"], torch.zeros(4, 3))
    other = PowerSGDState(rank=2)
    other.load_state_dict(saved)
    other.errors["w"].add_(1.0)
    assert torch.equal(saved["errors"]["w"], torch.zeros(4, 3))
