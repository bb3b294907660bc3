"""turbotrain tune --nproc: the data-parallel stage's space is compression x bucket size for the chosen
recipe, pruned by known costs and by comm/model.py's alpha-beta model with a stated margin (each with
its reason, in the report's pruned-axes table), the measured jobs are compared with the uncompressed
one, bad input stops the command with one line, and a tiny end-to-end tune on 2 ranks writes a
tuned.json whose DataParallelConfig loads back."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from turbotrain import Config
from turbotrain.cli import main
from turbotrain.comm.config import COMPRESSIONS, DataParallelConfig
from turbotrain.errors import ConfigError, HardwareError
from turbotrain.tune import dp_search
from turbotrain.tune.dp_prune import (DP_MODEL, PRUNE_MARGIN, DpFacts, compute_per_rank, dp_link, gradient_bytes,
                                      load_link_fit, price, prune_dp)
from turbotrain.tune.dp_search import (MIN_CHOICE_ROUNDS, _fit_two_rounds, check_dp_settings, choose_dp, onebit_problem,
                                       record_dp, run_dp_stage, two_round_capacity)
from turbotrain.tune.report import pruned_axes
from turbotrain.tune.row import TUNED_ENV, _build_tuned_row
from turbotrain.tune.search import TuneSettings, run_tune
from turbotrain.tune.space import BUCKET_MB_VALUES, DEFAULT_BUCKET_MB, enumerate_dp_space, enumerate_space
from turbotrain.workloads.user import user_workload


def _recipe(precision="bf16-master", fusion=("qkv",), compile="forward+loss", checkpoint=None, accumulate=2):
    return next(c for c in enumerate_space(8) if c.precision == precision and c.fusion == fusion
                and c.compile == compile and c.checkpoint == checkpoint and c.accumulate == accumulate)


def _facts(precision="bf16-master", params=2_000_000, compute_s=1.0, **changes):
    return DpFacts(params=params, precision=precision, world=2, compute_s=compute_s, bandwidth=1e10, **changes)


def _by_label(space):
    return {c.dp_label: c for c in space}


# ------------------------------------------------------------------------------------------ the space
def test_the_dp_space_is_compression_by_bucket_for_the_recipe_reference_first():
    recipe = _recipe()
    space = enumerate_dp_space(recipe)
    assert len(space) == len(COMPRESSIONS) * len(BUCKET_MB_VALUES)
    assert {(c.compression, c.bucket_mb) for c in space} == {(k, b) for k in COMPRESSIONS for b in BUCKET_MB_VALUES}
    assert space[0].is_dp_reference and sum(c.is_dp_reference for c in space) == 1
    assert space[0].compression is None and space[0].bucket_mb == DEFAULT_BUCKET_MB
    for c in space:  # every candidate trains the recipe; only the exchange differs
        config = c.config()
        assert (config.precision, config.fuse, config.compile, config.accumulate) == \
               ("bf16-master", ("qkv",), True, 2)
        assert config.data_parallel == DataParallelConfig(compression=c.compression, bucket_mb=c.bucket_mb)
        assert not c.is_baseline  # the single-process shadow run is never a data-parallel candidate
    assert recipe.status == "candidate" and not recipe.data_parallel  # the recipe itself is untouched


def test_the_compute_space_has_no_data_parallel_axes_and_the_dp_space_needs_its_reference():
    assert not any(c.data_parallel for c in enumerate_space(8))
    with pytest.raises(TypeError):
        enumerate_space(8, world_size=2)  # the axes are searched for the winner, not crossed with every recipe
    with pytest.raises(ConfigError, match="DDP's defaults"):
        enumerate_dp_space(_recipe(), compressions=("powersgd",))
    with pytest.raises(ConfigError, match="DDP's defaults"):
        enumerate_dp_space(_recipe(), bucket_mbs=(5.0,))


# ------------------------------------------------------------------------------------------ pruning
def test_known_costs_prune_no_op_casts_fp16_and_onebit_buckets_with_their_reasons():
    space = enumerate_dp_space(_recipe())
    left = prune_dp(space, _facts(), dp_link(2))
    c = _by_label(space)
    # bf16-master keeps bf16 gradients: casting them to bf16 is a no-op, to fp16 saves nothing
    assert c["bf16:25MB"].status == "pruned" and "no-op" in c["bf16:25MB"].reason
    assert c["fp16:5MB"].status == "pruned" and "same bytes" in c["fp16:5MB"].reason
    assert c["onebit:5MB"].status == "pruned" and "optimizer.step" in c["onebit:5MB"].reason
    assert all(x.pruned_axis == "data_parallel" for x in space if x.status == "pruned")
    # on plain loopback the exchange of 2 M parameters is small: the model prunes none of the rest
    assert {x.dp_label for x in left} == {"none:25MB", "none:5MB", "powersgd:25MB", "powersgd:5MB", "onebit:25MB"}
    assert left[0].is_dp_reference
    predicted = [x.estimates["predicted_seconds"] for x in left[1:]]
    assert predicted == sorted(predicted)


def test_fp32_gradients_keep_bf16_and_prune_fp16_in_its_favour():
    space = enumerate_dp_space(_recipe(precision="fp32", fusion=(), compile="none", accumulate=1))
    prune_dp(space, _facts(precision="fp32"), dp_link(2))
    c = _by_label(space)
    assert c["bf16:25MB"].status == "candidate"
    assert c["fp16:25MB"].status == "pruned" and "bf16 is measured in its place" in c["fp16:25MB"].reason


def test_onebit_is_pruned_when_the_optimizer_cannot_become_one_adam():
    sgd = user_workload(_tiny_model, _sgd, _tiny_batches())
    problem = onebit_problem(sgd)
    assert problem is not None and "Adam" in problem
    assert onebit_problem(user_workload(_tiny_model, _adamw, _tiny_batches())) is None
    space = enumerate_dp_space(_recipe())
    prune_dp(space, _facts(onebit_problem=problem), dp_link(2))
    onebit = _by_label(space)["onebit:25MB"]
    assert onebit.status == "pruned" and problem in onebit.reason


@pytest.mark.parametrize("comm_warmup, pruned", [(1, True), (6, True), (7, False), (None, False)])
def test_onebit_is_pruned_when_its_jobs_warm_up_too_briefly_to_freeze_the_variance(comm_warmup, pruned):
    space = enumerate_dp_space(_recipe())
    prune_dp(space, _facts(comm_warmup=comm_warmup), dp_link(2))
    onebit = _by_label(space)["onebit:25MB"]
    assert (onebit.status == "pruned") == pruned
    if pruned:
        assert f"after {comm_warmup} uncompressed step" in onebit.reason and "--warmup 8" in onebit.reason


def test_the_ring_price_matches_the_alpha_beta_formula_on_a_shaped_link():
    # an oracle written out by hand: 2 ranks share one egress shaped to 100 Mbit/s at TCP's 90%; a ring
    # all-reduce of S bytes takes 2(N-1) hops of alpha plus 2(N-1)/N x S over a rank's share of the link;
    # each extra DDP bucket adds one all-reduce's hops; backward (2/3 of the compute) hides the
    # exchange but the last bucket's
    params, world = 10_000_000, 2
    link = dp_link(world, "100mbit")
    bytes_per_s = 100e6 / 8 / world * 0.9
    hops = 2 * (world - 1) * link.alpha_s
    size = 4 * params  # fp32 gradients: 40 MB, two 25 MiB buckets
    bucket = 25 * 2**20
    exchange = hops + 2 * (world - 1) / world * size / bytes_per_s + hops  # the second bucket's hops
    last = hops + 2 * (world - 1) / world * bucket / bytes_per_s
    reference = enumerate_dp_space(_recipe(precision="fp32", fusion=(), compile="none", accumulate=1))[0]
    for compute, exposed in ((0.01, exchange - 2 / 3 * 0.01), (100.0, last)):
        figures = price(reference, _facts(precision="fp32", params=params, compute_s=compute), link)
        assert figures["buckets"] == 2
        assert figures["exchange_s"] == pytest.approx(exchange, rel=1e-9)
        assert figures["exposed_s"] == pytest.approx(exposed, rel=1e-9)
        assert figures["step_s"] == pytest.approx(compute + exposed, rel=1e-9)
    assert gradient_bytes("fp32") == 4 and gradient_bytes("bf16-master") == 2 and gradient_bytes("bf16-mixed") == 4


def test_a_slow_link_prunes_what_the_model_puts_past_the_margin_but_never_the_reference():
    space = enumerate_dp_space(_recipe(precision="fp32", fusion=(), compile="none", accumulate=1))
    link = dp_link(2, "10mbit")
    left = prune_dp(space, _facts(precision="fp32", params=20_000_000, compute_s=1.0), link)
    c = _by_label(space)
    best = min(left, key=lambda x: x.estimates["step_s"])
    assert best.compression == "powersgd"  # 40x fewer bytes than the ring, on a link where bytes are everything
    assert c["none:25MB"] in left  # the reference is measured whatever its prediction
    assert c["none:25MB"].estimates["step_s"] > PRUNE_MARGIN * best.estimates["step_s"]
    slow = c["none:5MB"]
    assert slow.status == "pruned" and f"{PRUNE_MARGIN}x margin" in slow.reason and "10mbit" in slow.reason
    known = [x for x in space if x.status == "pruned" and "margin" not in x.reason]
    assert {x.dp_label for x in known} == {"fp16:25MB", "fp16:5MB", "onebit:5MB"}  # pruned before the model
    for x in space:  # the margin rule, checked both ways against the estimates it wrote
        if x in known:
            continue
        over = x.estimates["step_s"] > PRUNE_MARGIN * best.estimates["step_s"]
        assert (x.status == "pruned") == (over and not x.is_dp_reference)


def test_dp_prunes_appear_in_the_pruned_axes_table_with_their_reasons():
    space = enumerate_dp_space(_recipe())
    prune_dp(space, _facts(), dp_link(2))
    groups = [g for g in pruned_axes(space) if g["axis"] == "data_parallel"]
    assert sum(g["candidates"] for g in groups) == sum(c.status == "pruned" for c in space) == 5
    values = {v for g in groups for v in g["values"]}
    assert values == {"bf16:25MB", "bf16:5MB", "fp16:25MB", "fp16:5MB", "onebit:5MB"}
    assert all(g["reason"] for g in groups)


def test_compute_per_rank_scales_to_the_threads_a_rank_gets():
    assert compute_per_rank(1.0, threads=2, world=2, cores=2) == 2.0  # 1 thread each instead of 2
    assert compute_per_rank(1.0, threads=4, world=2, cores=8) == 1.0  # 4 threads each, as measured
    assert compute_per_rank(1.0, threads=1, world=4, cores=2) == 2.0  # 4 single-thread ranks on 2 cores


# ------------------------------------------------------------------------- the user's link (--fit-json)
def _bench_rows(alpha, beta, world=2, op="all_reduce", sizes=tuple(4**k for k in range(5, 12)), noise=(0.0,)):
    """comm-bench's written rows (bench/comm_bench.py), timed alpha + beta x size, off by ``noise`` in turn."""
    return [{"workload": "comm-bench", "config": {"op": op, "size": size, "count": size // 4, "type": "float32",
                                                  "redop": "sum", "backend": "gloo", "world_size": world},
             "metric": "busbw", "unit": "GB/s", "time_us": (alpha + beta * size) * (1 + noise[i % len(noise)]) * 1e6}
            for i, size in enumerate(sizes)]


def _bench_file(tmp_path, rows, name="bench.json"):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return str(path)


#: A link far slower than the built-in loopback fit (1.034 GB/s of buffer, 267 us): 10 MB/s, 2 ms.
SLOW_ALPHA, SLOW_BETA = 2e-3, 1 / 10e6


def test_a_fitted_link_replaces_the_loopback_fit_and_prices_the_candidates_on_it(tmp_path):
    path = _bench_file(tmp_path, _bench_rows(SLOW_ALPHA, SLOW_BETA) + _bench_rows(1e-6, 1e-12, op="all_gather"))
    fit = load_link_fit(path, 2)
    assert (fit.op, fit.world) == ("all_reduce", 2)
    link = dp_link(2, fit=fit, source=path)
    # by hand, at 2 ranks: a ring all-reduce is 2 hops and moves 2(n-1)/n = 1 buffer over the link
    assert link.bytes_per_s == pytest.approx(10e6, rel=1e-6) and link.alpha_s == pytest.approx(SLOW_ALPHA / 2)
    assert "bench.json" in link.name and "plain loopback" not in link.name
    reference = enumerate_dp_space(_recipe(precision="fp32", fusion=(), compile="none", accumulate=1))[0]
    facts = _facts(precision="fp32", params=1_000_000, compute_s=0.01)  # 4 MB of gradient: one bucket, all exposed
    fitted, loopback = price(reference, facts, link), price(reference, facts, dp_link(2))
    assert fitted["exposed_s"] == pytest.approx(SLOW_ALPHA + SLOW_BETA * 4e6, rel=1e-6)  # the file's own time
    assert fitted["exposed_s"] > 50 * loopback["exposed_s"]
    # on this link bytes are everything: the model prunes what it keeps on loopback
    kept = {}
    for name, model_link in (("fitted", link), ("loopback", dp_link(2))):
        space = enumerate_dp_space(_recipe(precision="fp32", fusion=(), compile="none", accumulate=1))
        kept[name] = {c.dp_label for c in prune_dp(space, _facts(precision="fp32", params=20_000_000), model_link)}
        if name == "fitted":
            assert "bench.json" in _by_label(space)["none:5MB"].reason
    assert "none:5MB" in kept["loopback"] and "none:5MB" not in kept["fitted"]


def test_the_fit_of_the_runs_world_is_taken_else_the_largest_shared_out_as_loopbacks_is(tmp_path):
    alpha2, beta2, alpha4, beta4 = 100e-6, 1 / 1e9, 300e-6, 1 / 0.5e9
    path = _bench_file(tmp_path, _bench_rows(alpha2, beta2, world=2) + _bench_rows(alpha4, beta4, world=4)
                       + _bench_rows(1e-6, 1e-12, world=1))  # one rank exchanges nothing: never a link
    assert load_link_fit(path, 2).world == 2 and load_link_fit(path, 4).world == 4
    assert load_link_fit(path, 3).world == 4 and load_link_fit(path, 8).world == 4
    at_two = dp_link(2, fit=load_link_fit(path, 2), source=path)
    assert at_two.bytes_per_s == pytest.approx(1e9, rel=1e-6) and at_two.alpha_s == pytest.approx(alpha2 / 2)
    # fitted on 4 ranks: 2(n-1) = 6 hops and 2(n-1)/n = 1.5 buffers over the link; 8 ranks get 4/8 of it,
    # the rule the built-in fit of 2 ranks follows (1.034 GB/s x 2/8)
    at_eight = dp_link(8, fit=load_link_fit(path, 8), source=path)
    assert at_eight.bytes_per_s == pytest.approx(1.5 * 0.5e9 * 4 / 8, rel=1e-6)
    assert at_eight.alpha_s == pytest.approx(alpha4 / 6)
    assert dp_link(8).bytes_per_s == pytest.approx(1.034e9 * 2 / 8, rel=1e-6)


def test_the_dp_stage_prices_and_reports_the_users_fit(tmp_path, monkeypatch):
    import turbotrain.bench.dp_ladder as dp_ladder

    path = _bench_file(tmp_path, _bench_rows(SLOW_ALPHA, SLOW_BETA, noise=(0.1, -0.1)), name="my-network.json")
    monkeypatch.setattr(dp_search, "_measure", lambda *args, **kwargs: {})  # price only: no torchrun job
    monkeypatch.setattr(dp_ladder, "namespace_problem", lambda: "not probed in this test")
    recipe = _recipe(precision="fp32", fusion=(), compile="none", accumulate=1)
    recipe.measured = {"step_seconds": 0.5}
    workload = user_workload(_tiny_model, _adamw, _tiny_batches())

    def stage(fit_json):
        said = []
        dp = run_dp_stage(recipe, workload, {"workload": "gpt"}, params=20_000_000, world=2, link=None, steps=2,
                          warmup=8, seed=0, val_batches=1, bandwidth=1e10, threads=1, end=time.monotonic() + 60,
                          say=said.append, fit_json=fit_json)
        return dp, "\n".join(said)

    dp, said = stage(path)
    section, fit = dp.section, load_link_fit(path, 2)
    assert section["link_fit"]["file"] == path and section["link_fit"]["alpha_s"] == fit.alpha_s
    assert "my-network.json" in section["link"] and "my-network.json" in said
    assert section["link_model"]["alpha_s"] == pytest.approx(fit.alpha_s / 2)
    for text in (section["model"], said):  # where the link came from, its alpha, bandwidth and errors
        assert fit.describe() in text
    assert "the user's comm-bench fit in " + path in section["model"] and section["model"] != DP_MODEL
    assert "median" in fit.describe() and f"{fit.max_error:.1%}" in fit.describe()
    plain, _ = stage(None)
    assert plain.section["model"] == DP_MODEL and "docs/comm-plan.md" in DP_MODEL and plain.section["link_fit"] is None
    predicted = [next(c for c in d.candidates if c.is_dp_reference).estimates["step_s"] for d in (dp, plain)]
    assert predicted[0] > 10 * predicted[1]  # the slow fitted link, not loopback, priced the uncompressed job


def test_the_dp_stage_carries_an_every_other_block_recipe_into_its_jobs_and_its_config(monkeypatch):
    import turbotrain.bench.dp_ladder as dp_ladder
    from turbotrain.bench.dp_worker import LadderSpec, _build_engine
    from turbotrain.memory import checkpointed_blocks
    from turbotrain.workloads import get_workload

    specs = []
    monkeypatch.setattr(dp_search, "_measure", lambda survivors, base_spec, *args: specs.append(base_spec) or {})
    monkeypatch.setattr(dp_ladder, "namespace_problem", lambda: "not probed in this test")
    recipe = next(c for c in enumerate_space(8) if c.precision == "fp32" and not c.fusion and c.compile == "none"
                  and c.checkpoint_every == 2 and c.accumulate == 1)
    recipe.measured = {"step_seconds": 0.5}
    overrides = dict(d=32, n_layer=3, n_head=2, T=8, B=2, vocab_size=512)
    dp = run_dp_stage(recipe, user_workload(_tiny_model, _adamw, _tiny_batches()),
                      {"workload": "gpt", "overrides": overrides}, params=20_000, world=2, link=None, steps=2,
                      warmup=8, seed=0, val_batches=1, bandwidth=1e10, threads=1, end=time.monotonic() + 60,
                      say=lambda line: None)
    assert all(c.name.startswith("fp32+ckpt:blocks/2+dp:") for c in dp.candidates)
    assert dp.winner.config().checkpoint_every == 2  # what tuned.json holds
    spec = LadderSpec(row=dp.candidates[0].name, mode="local", **specs[0])  # a job's Config, without its ranks
    assert spec.checkpoint_every == 2
    workload = get_workload("gpt", **overrides)
    engine = _build_engine(spec, workload)
    assert torch.isfinite(engine.step(next(iter(workload.batches("train", 0)))).loss)
    assert [path for path, _ in checkpointed_blocks(engine.module)] == ["blocks.0", "blocks.2"]  # 3 blocks, every 2nd


def test_a_job_named_after_an_every_other_block_recipe_keeps_its_files_in_the_work_folder(tmp_path, monkeypatch):
    import turbotrain.bench.dp_ladder as dp_ladder
    from turbotrain.bench.dp_worker import LadderSpec

    class Exited:  # torchrun stands in: exits at once without a result, as a job that died does
        pid, returncode = 0, 1

        def __init__(self, cmd, **kwargs):
            pass

        def wait(self, timeout=None):
            return self.returncode

    monkeypatch.setattr(dp_ladder.subprocess, "Popen", Exited)
    spec = LadderSpec(row="fp32+ckpt:blocks/2+dp:none:25MB", mode="dp", checkpoint="blocks", checkpoint_every=2)
    result = dp_ladder.run_job(spec, 2, tmp_path, timeout=5)
    assert result["status"] == "error" and "job died" in result["error"]  # not a missing folder 'fp32_ckpt:blocks'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32_ckpt:blocks_2_dp:none:25MB.log",
                                                          "fp32_ckpt:blocks_2_dp:none:25MB.spec.json"]


# ------------------------------------------------------------------------------- recording, choosing
def _job(steps, val=3.0, wire=4_000_000):
    return {"status": "ok", "step_seconds": steps, "val_loss": val, "items_per_step": 8, "unit": "samples",
            "world_size": 2, "parameters": 1_000_000, "wire_bytes": wire * len(steps), "hook_bytes": None,
            "job_seconds": 10.0, "diverged": False, "replicas_in_sync": True}


def test_a_faster_job_within_the_loss_tolerance_wins_and_a_noisy_or_lossy_one_does_not():
    space = enumerate_dp_space(_recipe())
    c = _by_label(space)
    ref = _job([1.0, 1.02, 0.98, 1.01, 0.99])
    record_dp(c["none:25MB"], [ref, ref], ref, "bf16", "1gbit")
    psgd_job = _job([0.80, 0.82, 0.79, 0.81, 0.80], val=3.01, wire=100_000)
    record_dp(c["powersgd:25MB"], [psgd_job, psgd_job], ref, "bf16", "1gbit")
    record_dp(c["onebit:25MB"], [_job([0.70, 0.71, 0.69, 0.70, 0.72], val=3.3)], ref, "bf16", "1gbit")
    record_dp(c["none:5MB"], [_job([0.97, 1.05, 0.96, 1.04, 0.95])], ref, "bf16", "1gbit")
    record_dp(c["powersgd:5MB"], None, ref, "bf16", "1gbit")
    assert c["onebit:25MB"].status == "rejected" and "outside the 1% tolerance" in c["onebit:25MB"].reason
    psgd = c["powersgd:25MB"].measured
    assert psgd["ratio_vs_reference"] == pytest.approx(1.0 / 0.80) and psgd["rounds"] == 2
    assert psgd["ratio_ci95"][0] > 1.0 and psgd["wire_bytes_per_step"] == 100_000
    assert psgd["loss_delta_percent"] == pytest.approx(100 * 0.01 / 3.0)
    assert c["none:5MB"].measured["ratio_ci95"][0] <= 1.0 <= c["none:5MB"].measured["ratio_ci95"][1]
    assert c["powersgd:5MB"].status == "not reached"
    assert choose_dp(space) is c["powersgd:25MB"]  # onebit was faster but changed the loss
    c["powersgd:25MB"].status = "rejected"
    assert choose_dp(space) is c["none:25MB"]  # none:5MB is within the noise: the reference stays


def test_a_candidate_that_pays_in_one_round_is_not_chosen_and_is_told_why():
    space = enumerate_dp_space(_recipe())
    c = _by_label(space)
    ref, fast = _job([1.0, 1.02, 0.98, 1.01, 0.99]), _job([0.80, 0.82, 0.79, 0.81, 0.80])
    record_dp(c["none:25MB"], [ref], ref, "bf16", "1gbit")
    record_dp(c["powersgd:25MB"], [fast], ref, "bf16", "1gbit")
    assert c["powersgd:25MB"].measured["ratio_ci95"][0] > 1.0  # it pays within its one job...
    assert choose_dp(space) is c["none:25MB"]  # ...but one job each cannot show the drift between jobs
    assert "1 round(s)" in c["powersgd:25MB"].reason and f"needs {MIN_CHOICE_ROUNDS}" in c["powersgd:25MB"].reason
    record_dp(c["powersgd:25MB"], [fast, fast], ref, "bf16", "1gbit")
    assert choose_dp(space) is c["none:25MB"]  # the reference ran one round too
    record_dp(c["none:25MB"], [ref, ref], ref, "bf16", "1gbit")
    assert choose_dp(space) is c["powersgd:25MB"]


@pytest.mark.parametrize("left, job, keep", [(100.0, 20.0, 2), (59.0, 20.0, 0), (60.0, 20.0, 1), (1000.0, 20.0, 24)])
def test_two_round_capacity(left, job, keep):
    assert two_round_capacity(left, job) == keep
    if keep:  # 2 x keep candidate jobs and the reference once more fit; one more candidate would not
        assert (2 * keep + 1) * job <= left < (2 * (keep + 1) + 1) * job


def test_survivors_are_cut_to_what_two_rounds_hold_in_predicted_order():
    space = enumerate_dp_space(_recipe(precision="fp32", fusion=(), compile="none", accumulate=1))
    survivors = prune_dp(space, _facts(precision="fp32"), dp_link(2))
    reference, queue = survivors[0], survivors[1:]
    assert len(queue) >= 3
    kept, rest = _fit_two_rounds(survivors, list(queue), left_s=100.0, job_s=20.0)
    assert rest == queue[:2] and kept == [reference, *queue[:2]]
    assert all("two rounds hold 2" in c.reason and "raise --budget" in c.reason for c in queue[2:])
    # not even one candidate fits twice: all are kept for one informative round
    assert _fit_two_rounds(survivors, list(queue), left_s=50.0, job_s=20.0) == (survivors, queue)


def test_an_out_of_sync_or_failed_job_is_never_chosen():
    space = enumerate_dp_space(_recipe())
    c = _by_label(space)
    ref = _job([1.0] * 4)
    record_dp(c["none:25MB"], [ref], ref, "bf16", "1gbit")
    record_dp(c["powersgd:25MB"], [{**_job([0.5] * 4), "replicas_in_sync": False}], ref, "bf16", "1gbit")
    record_dp(c["none:5MB"], [{"status": "error", "error": "job died (exit code 1): boom", "job_seconds": 3.0}],
              ref, "bf16", "1gbit")
    assert c["powersgd:25MB"].status == "rejected" and "out of sync" in c["powersgd:25MB"].reason
    assert c["none:5MB"].status == "error" and "boom" in c["none:5MB"].reason
    assert choose_dp(space) is c["none:25MB"]


# ----------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, words", [
    (["tune", "--quick", "--link", "1gbit"], "--nproc"),
    (["tune", "--quick", "--nproc", "1"], "at least 2 ranks"),
    (["tune", "--quick", "--nproc", "2", "--link", "fast"], "tc rate"),
])
def test_bad_dp_input_exits_2_with_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("turbotrain tune: error: ") and words in err[0]


def _never_searched(*args, **kwargs):
    raise AssertionError("the search started before the bad input was refused")


@pytest.mark.parametrize("case, words", [
    ("no --nproc", "give --nproc N"),
    ("with --link", "choose one"),
    ("missing", "cannot be read"),
    ("not json", "is not comm-bench JSON"),
    ("an object", "is not comm-bench JSON"),
    ("not rows", "is not a comm-bench row"),
    ("no all_reduce", "no all_reduce rows with two or more sizes"),
    ("one size", "no all_reduce rows with two or more sizes"),
    ("one rank", "no all_reduce rows with two or more sizes"),
    ("flat", "give no bandwidth"),
])
def test_a_bad_fit_json_exits_2_with_one_line_before_the_search(case, words, tmp_path, capsys, monkeypatch):
    import turbotrain.tune.search as search

    monkeypatch.setattr(search, "run_tune", _never_searched)
    good = _bench_file(tmp_path, _bench_rows(100e-6, 1e-9), name="good.json")
    files = {"not json": "hello", "an object": json.dumps({"rows": _bench_rows(100e-6, 1e-9)}),
             "not rows": json.dumps([{"op": "all_reduce", "size": 4}]),
             "no all_reduce": json.dumps(_bench_rows(100e-6, 1e-9, op="all_gather")),
             "one size": json.dumps(_bench_rows(100e-6, 1e-9, sizes=(4096,)) + _bench_rows(1e-6, 1e-12, world=4)[:1]),
             "one rank": json.dumps(_bench_rows(100e-6, 1e-9, world=1)),
             "flat": json.dumps([{**r, "time_us": 100.0 - i} for i, r in enumerate(_bench_rows(100e-6, 1e-9))])}
    path = str(tmp_path / "bad.json")
    if case in files:
        (tmp_path / "bad.json").write_text(files[case])
    argv = {"no --nproc": ["--fit-json", good], "with --link": ["--nproc", "2", "--link", "1gbit", "--fit-json", good]
            }.get(case, ["--nproc", "2", "--fit-json", path])
    assert main(["tune", "--quick", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("turbotrain tune: error: ")
    assert "--fit-json" in err[0] and words in err[0]
    assert (good if case in ("no --nproc", "with --link") else path) in err[0]
    assert not (tmp_path / "out" / "tuned.json").exists()


def test_the_cli_hands_the_fit_to_the_search(tmp_path, monkeypatch):
    import turbotrain.tune.search as search

    class Searched(Exception):
        pass

    def capture(workload, settings, *args, **kwargs):
        seen.append(settings)
        raise Searched

    seen = []
    monkeypatch.setattr(search, "run_tune", capture)
    path = _bench_file(tmp_path, _bench_rows(100e-6, 1e-9))
    with pytest.raises(Searched):
        main(["tune", "--quick", "--nproc", "2", "--fit-json", path, "--out", str(tmp_path / "out")])
    assert seen[0].fit_json == path and seen[0].world_size == 2 and seen[0].link is None
    with pytest.raises(ConfigError, match="world_size"):
        TuneSettings(fit_json=path)
    with pytest.raises(ConfigError, match="choose one"):  # the Python API is refused as the CLI is
        run_tune(None, TuneSettings(world_size=2, link="1gbit", fit_json=path), tmp_path / "api",
                 workload_spec={"workload": "gpt"})


def test_a_link_that_cannot_be_shaped_here_is_refused_before_the_search(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root: no network namespace can be made
    with pytest.raises(HardwareError, match="root"):
        check_dp_settings(2, "1gbit")
    t0 = time.monotonic()
    assert main(["tune", "--quick", "--nproc", "2", "--link", "1gbit", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "root" in err[0] and time.monotonic() - t0 < 30
    assert not (tmp_path / "out" / "tuned.json").exists()


def test_settings_and_run_tune_refuse_what_the_dp_stage_cannot_do(tmp_path):
    with pytest.raises(ConfigError, match="world_size"):
        TuneSettings(link="1gbit")
    with pytest.raises(ConfigError, match="tc rate"):
        TuneSettings(world_size=2, link="1 gig")
    with pytest.raises(ConfigError, match="one process"):  # the Python API's user workloads travel by pickle
        run_tune(None, TuneSettings(world_size=2), tmp_path, workload_spec={"workload": "user", "payload": "x.pkl"})


def test_the_tuned_bench_row_times_the_recipe_of_a_data_parallel_tuned_json(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(enumerate_dp_space(_recipe(precision="fp32", fusion=(), compile="none",
                                                          accumulate=2))[3].config().to_dict()))
    assert Config.from_json(path.read_text()).data_parallel is not None
    monkeypatch.setenv(TUNED_ENV, str(path))
    trainer = _build_tuned_row(user_workload(_tiny_model, _adamw, _tiny_batches(), loss_fn=_loss), "cpu")
    assert trainer.engine.config.data_parallel is None and trainer.micro_batches == 2
    assert torch.isfinite(trainer.step(_tiny_batches()[0]))


# ----------------------------------------------------------------------------------- end to end
@pytest.mark.dist
def test_a_quick_tune_on_two_ranks_writes_a_data_parallel_tuned_json(tmp_path):
    out = tmp_path / "tune"
    budget = 75
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "turbotrain.cli", "tune", "--workload", "gpt", "--quick",
                           "--budget", f"{budget}s", "--nproc", "2", "--steps", "3", "--rounds", "3",
                           "--warmup", "1", "--max-candidates", "1", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=240)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    tuned = json.loads((out / "tuned.json").read_text())
    assert isinstance(tuned.get("data_parallel"), dict)
    config = Config.from_json((out / "tuned.json").read_text())
    assert isinstance(config.data_parallel, DataParallelConfig)
    doc = json.loads((out / "tune.json").read_text())
    dp = doc["data_parallel"]
    reference = next(c for c in dp["candidates"] if c["name"] == dp["reference"])
    assert reference["status"] == "measured", reference["reason"]
    assert reference["measured"]["steps"] >= 3 and reference["measured"]["val_loss"] is not None
    assert doc["winner"]["config"] == tuned and doc["winner"]["name"].startswith(doc["compute_winner"]["name"] + "+dp:")
    assert any(g["axis"] == "data_parallel" for g in doc["pruned_axes"])
    assert doc["tuner_wall_seconds"] <= budget and wall <= budget + 20
    assert "Data parallel: 2 ranks" in (out / "tune.md").read_text()


# ------------------------------------------------------------------------------ a tiny user model
def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-2)


def _loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _tiny_batches(count=4):
    g = torch.Generator().manual_seed(0)
    return [(ids, (ids + 1) % 16) for ids in (torch.randint(0, 16, (4, 6), generator=g) for _ in range(count))]
