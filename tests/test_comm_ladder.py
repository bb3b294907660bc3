"""The data-parallel ladder: arithmetic and argument checks in-process, one quick two-rank ladder end to end."""

from __future__ import annotations

import doctest
import io
import json
import statistics

import pytest
import torch

from turbotrain.bench import dp_ladder as ladder
from turbotrain.bench.dp_ladder import (
    check_link,
    comm_overhead,
    link_floor_seconds,
    parse_rate,
    row_metrics,
    run_dp_ladder,
    shape_link_script,
)
from turbotrain.cli import build_parser, main
from turbotrain.errors import ConfigError, HardwareError

#: The fixed key columns every benchmark row carries (the single-process bench's schema).
KEY_COLUMNS = {"workload", "config", "metric", "unit", "median", "p20", "p80", "device", "versions", "timestamp"}


def test_docstring_examples_run():
    assert doctest.testmod(ladder).failed == 0


def test_comm_overhead_is_the_share_of_the_dp_step():
    assert comm_overhead(4.0, 3.0) == pytest.approx(0.25)
    assert comm_overhead(1.0, 1.2) == pytest.approx(-0.2)  # noise can make local slower; shown, not hidden
    with pytest.raises(ConfigError):
        comm_overhead(0.0, 1.0)


@pytest.mark.parametrize("rate, bits", [("1gbit", 1e9), ("500mbit", 5e8), ("100mbps", 8e8), ("2.5Gbit", 2.5e9)])
def test_parse_rate_reads_tc_units(rate, bits):
    assert parse_rate(rate) == pytest.approx(bits)


def test_parse_rate_rejects_other_spellings():
    with pytest.raises(ConfigError, match="1gbit"):
        parse_rate("1 GB/s")


def test_link_floor_counts_every_rank_through_one_link():
    # 2 ranks, 125 MB buffer: each sends 125 MB, both through one 1 Gbit/s egress -> 2 s
    assert link_floor_seconds(125e6, 2, "1gbit") == pytest.approx(2.0)
    assert link_floor_seconds(125e6, 4, "1gbit") == pytest.approx(6.0)


def test_check_link_refuses_without_root(monkeypatch):
    monkeypatch.setattr(ladder.os, "geteuid", lambda: 1000)
    with pytest.raises(HardwareError, match="needs root"):
        check_link("1gbit")


def test_check_link_refuses_without_tc(monkeypatch):
    monkeypatch.setattr(ladder.os, "geteuid", lambda: 0)
    monkeypatch.setattr(ladder.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    with pytest.raises(HardwareError, match="iproute2"):
        check_link("1gbit")


def _fake_result(times, val=8.0, rounds=None, calls=None):
    return {"status": "ok", "step_seconds": times, "items_per_step": 1000, "unit": "tokens", "val_loss": val,
            "exchange_rounds": len(times) if rounds is None else rounds,
            "collective_calls": 2 * len(times) if calls is None else calls}


def test_row_metrics_combine_dp_local_and_baseline():
    dp, local = _fake_result([1.0, 1.2, 1.1, 5.0, 1.05]), _fake_result([0.8, 0.9, 0.85, 0.7, 0.95], val=None)
    base = _fake_result([1.0], val=7.5)
    m = row_metrics(dp, local, base)
    t_dp, t_local = statistics.median(dp["step_seconds"]), statistics.median(local["step_seconds"])
    assert m["comm_overhead"]["median"] == pytest.approx((t_dp - t_local) / t_dp)
    assert m["throughput"]["median"] == pytest.approx(1000 / t_dp)
    assert m["val_loss_delta"]["median"] == pytest.approx(100 * (8.0 - 7.5) / 7.5)
    assert m["exchange_rounds_per_step"]["median"] == 1
    assert m["step_time"]["p20"] <= m["step_time"]["median"] <= m["step_time"]["p80"]


def test_row_metrics_without_local_or_baseline_leave_those_out():
    m = row_metrics(_fake_result([1.0, 2.0]), {"status": "error", "error": "x"}, None)
    assert "comm_overhead" not in m and "val_loss_delta" not in m and "step_time" in m


def test_bad_names_and_sizes_raise_before_any_job():
    with pytest.raises(ConfigError, match="ddp\\+powersgd"):
        run_dp_ladder(configs=["ddp+zstd"], quick=True)
    with pytest.raises(ConfigError, match="nproc"):
        run_dp_ladder(nproc=1, quick=True)
    with pytest.raises(ConfigError, match="warmup"):
        run_dp_ladder(warmup=1, quick=True)


def test_bench_nproc_runs_the_dp_ladder_and_reports_bad_configs(tmp_path, capsys):
    assert main(["bench", "--nproc", "2", "--configs", "ddp,nope", "--quick", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("turbotrain bench: error:") and "'nope'" in err[0]


def test_dp_bench_is_gone_bench_nproc_has_its_options(capsys):
    # `bench --nproc` is the data-parallel ladder; the duplicate `dp-bench` command was removed
    with pytest.raises(SystemExit):
        build_parser().parse_args(["dp-bench"])
    assert "invalid choice: 'dp-bench'" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "--nproc", "2", "--link", "1gbit", "--steps", "3"])
    assert (args.nproc, args.link, args.steps) == (2, "1gbit", 3)


def test_shape_link_script_ships_as_package_data():
    path = shape_link_script()
    assert path.is_file() and path.name == "shape-link.sh"
    assert "turbotrain/bench/data" in path.as_posix()  # found through the package, not the source tree


def test_error_with_rich_markup_is_printed_literally_after_the_results_are_written(tmp_path, monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(ladder, "_run_job", lambda spec, *a, **k: {"status": "error", "error": "boom [/] [red]x",
                                                                  "job_seconds": 0.0})
    console = Console(file=io.StringIO(), width=200)
    doc = run_dp_ladder(configs=["ddp"], quick=True, precision="fp32", out_dir=tmp_path, console=console)
    assert json.loads((tmp_path / "dp_results.json").read_text()) == doc
    assert doc["configs"]["ddp"]["error"] == "boom [/] [red]x"
    assert "boom [/] [red]x" in console.file.getvalue()  # escaped, so neither a MarkupError nor red


def test_rounds_alternate_the_job_order_and_pool_their_steps(tmp_path, monkeypatch):
    from rich.console import Console

    calls = []

    def fake_job(spec, nproc, link, workdir, timeout, tag=""):
        calls.append((spec.row, spec.steps, tag))
        return {"status": "error", "error": "stop here", "job_seconds": 0.0} if spec.row == "ddp+bf16" else \
            {"status": "ok", "step_seconds": [1.0] * spec.steps, "val_loss": 5.0, "job_seconds": 1.0,
             "items_per_step": 8, "unit": "tokens", "world_size": 2, "wire_bytes": 100, "parameters": 10,
             "gradient_bytes": 40}

    monkeypatch.setattr(ladder, "_run_job", fake_job)
    doc = run_dp_ladder(configs=["ddp", "ddp+bf16"], steps=5, rounds=3, quick=True, precision="fp32",
                        out_dir=tmp_path, console=Console(file=io.StringIO(), width=200))
    # round 1 in ladder order, round 2 reversed, round 3 in order again; 5 steps split 2, 2, 1;
    # the failed row is not run again
    assert calls == [("local", 2, ".r0"), ("ddp", 2, ".r0"), ("ddp+bf16", 2, ".r0"),
                     ("ddp", 2, ".r1"), ("local", 2, ".r1"),
                     ("local", 1, ".r2"), ("ddp", 1, ".r2")]
    ddp = doc["configs"]["ddp"]
    assert ddp["rounds"] == 3 and len(ddp["step_seconds"]) == 5 and len(ddp["per_round"]) == 3
    assert ddp["metrics"]["wire_bytes_per_step"]["median"] == 300 / 5  # counters summed, per pooled step
    assert doc["configs"]["ddp+bf16"]["status"] == "error"
    with pytest.raises(ConfigError, match="rounds=6 is more than steps=5"):
        run_dp_ladder(configs=["ddp"], steps=5, rounds=6, out_dir=tmp_path)


@pytest.mark.dist
def test_quick_ladder_end_to_end(tmp_path):
    doc = run_dp_ladder(configs=["ddp", "ddp+accumulate4"], steps=2, rounds=2, warmup=2, quick=True,
                        out_dir=tmp_path)
    assert json.loads((tmp_path / "dp_results.json").read_text()) == doc
    from turbotrain.precision.policy import resolve_precision

    auto = resolve_precision("auto", torch.device("cpu"))[0]  # the ladder's default, resolved once
    assert doc["header"]["link"] == "loopback" and doc["header"]["precision"] == auto
    assert any("'auto' chose" in note for note in doc["header"]["notes"])
    assert doc["rows"] and all(KEY_COLUMNS <= set(row) for row in doc["rows"])
    for name in ("ddp", "ddp+accumulate4"):
        row = doc["configs"][name]
        assert row["status"] == "ok", row.get("error")
        assert row["local"]["status"] == "ok", row["local"].get("error")
        assert row["replicas_in_sync"] is True and row["world_size"] == 2 and row["threads"] == 1
        assert row["local"]["exchange_rounds"] == 0  # the local job really does not communicate
        t_dp, t_local = statistics.median(row["step_seconds"]), statistics.median(row["local"]["step_seconds"])
        assert row["metrics"]["comm_overhead"]["median"] == pytest.approx((t_dp - t_local) / t_dp)
    acc = doc["configs"]["ddp+accumulate4"]
    assert acc["micro_batches_per_step"] == 4 and acc["local_job"] == "local+accumulate4"
    assert acc["metrics"]["exchange_rounds_per_step"]["median"] == 1  # one exchange per 4 micro-batches
    assert doc["configs"]["ddp"]["metrics"]["val_loss_delta"]["median"] == 0.0
    ddp = doc["configs"]["ddp"]
    assert ddp["rounds"] == 2 and [len(r["step_seconds"]) for r in ddp["per_round"]] == [1, 1]
    assert ddp["per_round"][0]["val_loss"] == ddp["per_round"][1]["val_loss"]  # the same run, repeated
    wire = ddp["metrics"]["wire_bytes_per_step"]
    if ladder.namespace_problem() is None:
        # Counted off the job's own loopback: a 2-rank ring all-reduce moves each gradient byte
        # twice in all (2(n-1) buffers), plus TCP headers and the barriers; the local job sends ~0.
        assert wire["source"] == "loopback counter"
        assert 2 * ddp["gradient_bytes"] <= wire["median"] <= 1.1 * 2 * ddp["gradient_bytes"]
        assert row["local"]["wire_bytes"] < 0.01 * ddp["wire_bytes"]
    else:
        assert wire["source"] == "DDP hook payload, as a ring"
    assert ddp["metrics"]["link_floor"]["median"] == pytest.approx(wire["median"] * 8 / 1e9)


@pytest.mark.slow
@pytest.mark.dist
def test_quick_ladder_on_a_shaped_link(tmp_path):
    try:
        check_link("1gbit")
    except HardwareError as exc:
        pytest.skip(f"no shaped link here: {exc}")
    doc = run_dp_ladder(configs=["ddp"], steps=2, warmup=2, quick=True, link="100mbit", out_dir=tmp_path)
    row = doc["configs"]["ddp"]
    assert row["status"] == "ok", row.get("error")
    assert doc["header"]["link"] == "100mbit" and all(r["link"] == "100mbit" for r in doc["rows"])
    # A physical bound, not a speed claim: were the job not shaped, this would fail.
    assert min(row["step_seconds"]) >= doc["header"]["link_floor_seconds"]


def test_sparse_rows_run_their_own_local_job_in_their_own_precision(tmp_path, monkeypatch):
    from rich.console import Console

    specs = []

    def fake_job(spec, nproc, link, workdir, timeout, tag=""):
        specs.append(spec)
        hybrid = spec.row == "ddp+hybrid"
        return {"status": "ok", "step_seconds": [1.2 if hybrid else 1.0] * spec.steps, "val_loss": 5.0,
                "job_seconds": 1.0, "items_per_step": 8, "unit": "tokens", "world_size": 2, "wire_bytes": 100,
                "parameters": 10, "gradient_bytes": 40, "params_checksum": 3.0 + 3e-9 * hybrid}

    monkeypatch.setattr(ladder, "_run_job", fake_job)
    doc = run_dp_ladder(configs=["ddp", "ddp+sparse", "ddp+hybrid"], steps=2, quick=True, precision="bf16-master",
                        out_dir=tmp_path, console=Console(file=io.StringIO(), width=200))
    got = {(s.row, s.mode): (s.precision, s.sparse_embedding, s.strategy) for s in specs}
    assert got == {("local", "local"): ("bf16-master", False, "ring"), ("ddp", "dp"): ("bf16-master", False, "ring"),
                   ("local+sparse@fp32", "local"): ("fp32", True, "ring"),
                   ("ddp+sparse", "dp"): ("fp32", True, "ring"), ("ddp+hybrid", "dp"): ("fp32", True, "hybrid")}
    hybrid = doc["configs"]["ddp+hybrid"]
    assert hybrid["local_job"] == "local+sparse@fp32" and hybrid["precision"] == "fp32"
    assert hybrid["twin"] == "ddp+sparse" and doc["configs"]["ddp"]["precision"] == "bf16-master"
    m = hybrid["metrics"]
    assert m["step_time_vs_twin"]["median"] == pytest.approx(1.2)
    assert m["params_checksum_vs_twin"]["median"] == pytest.approx(1e-9)
    assert m["val_loss_delta_vs_twin"]["median"] == 0.0
    assert "step_time_vs_twin" not in doc["configs"]["ddp+sparse"]["metrics"]
    notes = doc["header"]["notes"]
    assert any(n.startswith("ddp+hybrid vs ddp+sparse") and "1.20" in n for n in notes)
    assert any(n.startswith("ddp+sparse and its local job run in fp32, not bf16-master") for n in notes)


def test_local_keys_of_the_sparse_rows_invert():
    assert ladder.local_key(ladder.DP_ROWS["ddp+sparse"]) == "local+sparse@fp32"
    assert ladder._local_settings("local+sparse@fp32") == {"accumulate": 1, "checkpoint": None,
                                                          "sparse_embedding": True, "precision": "fp32"}
    assert "precision" not in ladder._local_settings("local+accumulate4")  # the ladder's precision


def test_sparse_embedding_optimizer_steps_the_touched_rows_with_sparse_adam():
    from turbotrain import Config, Engine
    from turbotrain.bench.dp_worker import LadderSpec, SteppedTogether, sparse_embedding_optimizer, state_bytes
    from turbotrain.workloads import get_workload

    wl = get_workload("gpt", d=32, n_layer=1, n_head=2, T=16, B=8)
    model = wl.build_model()
    before = model.wte.weight.detach().clone()
    head = model.lm_head.weight.detach().clone()
    opt = sparse_embedding_optimizer(model)
    assert model.wte.sparse and [type(o).__name__ for o in opt.optimizers] == ["SparseAdam", "AdamW"]
    engine = Engine(model, opt, wl.loss_fn, config=Config(precision="fp32", device="cpu"))
    batch = next(wl.batches(split="train", seed=0, device="cpu"))
    engine.step(batch)
    assert engine.optimizer is opt and isinstance(opt, SteppedTogether)
    seen = torch.unique(batch[0])  # (tokens, targets)
    moved = (model.wte.weight.detach() != before).any(dim=1)
    assert moved[seen].all() and moved.sum() == len(seen)  # SparseAdam: the touched rows, and only those
    assert not torch.equal(model.lm_head.weight.detach(), head)  # AdamW stepped the rest
    assert set(opt.state) == {p for g in opt.param_groups for p in g["params"]}  # one shared state
    without = state_bytes(model, opt)
    model.wte.weight.grad = torch.sparse_coo_tensor([[0, 3]], torch.ones(2, 32), model.wte.weight.shape,
                                                     check_invariants=True)
    assert state_bytes(model, opt) - without == 2 * 8 + 2 * 32 * 4  # a sparse gradient: its indices and rows
    with pytest.raises(ConfigError, match="sparse_embedding"):
        LadderSpec(row="x", mode="dp", sparse_embedding=True, parallel={"dp_shard": -1})


@pytest.mark.slow
@pytest.mark.dist
def test_quick_hybrid_row_sends_the_embedding_through_the_server_and_matches_its_twin(tmp_path):
    doc = run_dp_ladder(configs=["ddp+sparse", "ddp+hybrid"], steps=2, rounds=1, warmup=2, quick=True,
                        out_dir=tmp_path)
    assert json.loads((tmp_path / "dp_results.json").read_text()) == doc
    sparse, hybrid = doc["configs"]["ddp+sparse"], doc["configs"]["ddp+hybrid"]
    for row in (sparse, hybrid):
        assert row["status"] == "ok", row.get("error")
        assert row["local"]["status"] == "ok", row["local"].get("error")
        assert row["replicas_in_sync"] is True and row["optimizer"] == "SparseAdam + AdamW"
        assert row["local_job"] == "local+sparse@fp32" and "fp32" in row["engine"]
    # The same sums in another order of collectives: the same parameters after 4 steps.
    assert hybrid["metrics"]["params_checksum_vs_twin"]["median"] == pytest.approx(0.0, abs=1e-7)
    assert hybrid["val_loss"] == pytest.approx(sparse["val_loss"], rel=1e-6)
    # The parameter-server path: an all_gather of counts, gather x2 and broadcast x3 onto one server,
    # against the all-gather path's 3 collectives; the dense buckets' calls are the same in both.
    calls = [row["metrics"]["collective_calls_per_step"]["median"] for row in (sparse, hybrid)]
    assert calls[1] - calls[0] == 3
    s = doc["header"]["workload"]["settings"]
    embedding_bytes = 4 * s["vocab_size"] * s["d"]
    for row in (sparse, hybrid):  # the embedding's rows travel sparsely: far less than its dense ring share
        assert row["metrics"]["wire_bytes_per_step"]["median"] < 2 * row["gradient_bytes"] - embedding_bytes
