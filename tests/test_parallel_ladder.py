"""The sharded rows of the data-parallel ladder (fsdp, fsdp+ckpt, tp, tp+sp) and the enforced state cap."""

from __future__ import annotations

import doctest
import json

import pytest
import torch

from turbotrain.bench import dp_worker
from turbotrain.bench.dp_ladder import DP_ROWS, local_key, row_metrics, run_dp_ladder
from turbotrain.bench.dp_worker import LadderSpec, StateMeter, state_bytes
from turbotrain.errors import ConfigError
from turbotrain.parallel import ParallelConfig, ResolvedDegrees


def test_worker_docstring_examples_run():
    assert doctest.testmod(dp_worker).failed == 0


@pytest.mark.parametrize("name, degrees, checkpoint", [
    ("fsdp", (1, 2, 1), None), ("fsdp+ckpt", (1, 2, 1), "blocks"), ("tp", (1, 1, 2), None), ("tp+sp", (1, 1, 2), None),
])
def test_sharded_rows_on_two_ranks(name, degrees, checkpoint):
    row = DP_ROWS[name]
    cfg = ParallelConfig(**row.parallel)
    assert cfg.resolve(2) == ResolvedDegrees(*degrees)  # dp_shard=2, or dp_shard=1 x tp=2
    assert cfg.sequence_parallel == (name == "tp+sp")
    assert row.checkpoint == checkpoint and row.compression is None
    assert local_key(row) == ("local+ckpt" if checkpoint else "local")


def test_tensor_parallel_rows_need_an_even_nproc():
    with pytest.raises(ConfigError, match="tp\\+sp.*--nproc 3"):
        run_dp_ladder(configs=["ddp", "tp+sp"], nproc=3, quick=True)
    with pytest.raises(ConfigError, match="max_state_bytes"):
        run_dp_ladder(configs=["fsdp"], max_state_bytes=0, quick=True)


def test_spec_refuses_parallel_with_compression_or_locally():
    with pytest.raises(ConfigError, match="compression"):
        LadderSpec(row="x", mode="dp", compression="bf16", parallel={"dp_shard": -1})
    with pytest.raises(ConfigError, match="dp-mode"):
        LadderSpec(row="x", mode="local", parallel={"dp_shard": -1})


def _result(times, state, val=8.0, rounds=None):
    return {"status": "ok", "step_seconds": times, "items_per_step": 1000, "unit": "tokens", "val_loss": val,
            "exchange_rounds": rounds, "collective_calls": rounds, "state_bytes_peak": state,
            "rss_peak_bytes": 500 * 2**20}


def test_row_metrics_of_a_sharded_row_against_ddp():
    ddp, local = _result([1.0, 1.0, 1.0], 1600, rounds=3), _result([0.8, 0.8, 0.8], 1600)
    tp = _result([0.6, 0.6, 0.6], 820, val=8.08)
    m = row_metrics(tp, local, ddp, tp=2)
    # the local step split over the 2 tensor-parallel ranks is the ideal: (0.6 - 0.4) / 0.6
    assert m["comm_overhead"]["median"] == pytest.approx(1 / 3)
    assert m["step_time_vs_ddp"]["median"] == pytest.approx(0.6)
    assert m["state_bytes_vs_ddp"]["median"] == pytest.approx(820 / 1600)
    assert m["state_bytes_peak"]["median"] == 820 and m["rss_peak"]["median"] == 500 * 2**20
    # its ranks train the same rows: the loss is compared with the one-process job's, not with ddp's
    assert m["val_loss_delta"]["median"] == pytest.approx(1.0) and "one-process" in m["val_loss_delta"]["unit"]
    assert row_metrics(tp, local, _result([1.0], 1600, val=7.0), tp=2)["val_loss_delta"]["median"] == pytest.approx(1.0)
    assert row_metrics(tp, local, ddp, tp=1)["val_loss_delta"]["unit"] == "% vs ddp"
    assert "exchange_rounds_per_step" not in m  # FSDP's and DTensor's collectives are not counted
    assert row_metrics(ddp, local, ddp)["exchange_rounds_per_step"]["median"] == 1


def test_state_bytes_counts_parameters_gradients_and_adam_state_once_per_storage():
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    net[1].weight = net[0].weight  # tied: one storage
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    n = 40 * 4  # one 10x4 FP32 matrix
    assert state_bytes(net, opt) == n
    net(torch.tensor([1, 2])).sum().backward()
    assert state_bytes(net, opt) == 2 * n
    opt.step()
    # + exp_avg and exp_avg_sq, and the FP32 step counter (4 bytes)
    assert state_bytes(net, opt) == 4 * n + 4


def test_state_meter_reads_around_every_optimizer_step():
    class Holder:
        module = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    meter = StateMeter(Holder)
    Holder.module(torch.randn(2, 4)).sum().backward()
    Holder.optimizer.step()
    assert meter.peak == 4 * 80 + 2 * 4  # 20 FP32 values x 4 (param, grad, 2 moments) + 2 step counters
    meter.close()


@pytest.mark.slow
@pytest.mark.dist
def test_cap_that_ddp_exceeds_is_trained_under_by_every_sharded_row(tmp_path):
    """The memory-cap demonstration, by the command a user runs: DDP stops at the cap, FSDP2 and TP train."""
    from turbotrain.bench.runner import quick_overrides
    from turbotrain.cli import main
    from turbotrain.workloads import get_workload

    n = sum(p.numel() for p in get_workload("gpt", **quick_overrides("gpt")).build_model().parameters())
    # fp32: DDP holds 16 bytes a parameter (weight, gradient, two Adam moments); two shards hold
    # about 8 each. The cap between them is what neither can meet by luck.
    cap = 12 * n
    out = tmp_path / "o"
    configs = "ddp,fsdp,fsdp+ckpt,tp,tp+sp"
    assert main(["bench", "--nproc", "2", "--configs", configs, "--quick", "--steps", "2", "--warmup", "2",
                 "--dp-precision", "fp32", "--max-state-bytes", str(cap), "--out", str(out)]) == 0
    doc = json.loads((out / "dp_results.json").read_text())
    assert doc["header"]["max_state_bytes"] == cap
    ddp = doc["configs"]["ddp"]
    assert ddp["status"] == "error" and "StateCapExceeded" in ddp["error"] and "after optimizer step 1" in ddp["error"]
    for name in configs.split(",")[1:]:
        row = doc["configs"][name]
        assert row["status"] == "ok", row.get("error")
        assert row["max_state_bytes"] == cap and row["world_size"] == 2 and not row["diverged"]
        assert max(row["state_bytes_peak_per_rank"]) == row["state_bytes_peak"] <= cap
        assert row["state_bytes_peak"] <= 0.55 * 16 * n  # about half of the unsharded state
        assert row["rss_peak_bytes"] > row["state_bytes_peak"]  # the whole process holds far more
        assert row["local"]["status"] == "ok" and "comm_overhead" in row["metrics"]
    assert doc["configs"]["fsdp+ckpt"]["local_job"] == "local+ckpt"
    assert doc["configs"]["tp"]["data_parallel_size"] == 1 and doc["configs"]["fsdp"]["data_parallel_size"] == 2
    # checkpointing recomputes, it changes no arithmetic: the same val loss as plain FSDP
    vals = {name: doc["configs"][name]["val_loss"] for name in ("fsdp", "fsdp+ckpt", "tp", "tp+sp")}
    assert vals["fsdp+ckpt"] == pytest.approx(vals["fsdp"], rel=1e-5)
    assert vals["tp+sp"] == pytest.approx(vals["tp"], rel=1e-5)
    assert any("stopped by it: ddp" in note for note in doc["header"]["notes"])
