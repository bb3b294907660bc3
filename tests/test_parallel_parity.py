"""Convergence tier of turbotrain.parallel: 100 Engine steps on 2 gloo ranks track one plain process.

The sharded runs go through the Engine (``Config(parallel=...)``); the oracle is torch alone: the
unsharded gpt, the global batch, AdamW (``reference`` in test_parallel_dist, which imports nothing
from turbotrain but the workload). FSDP's ranks each train on half of every global batch, so their
mean loss is the global batch's; a tensor-parallel pair trains on the whole batch together.
"""

from __future__ import annotations

import pytest
import torch

from test_parallel_dist import LR, WORLD, reference, result, rows, spawn, text_batches, workload

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 100
TOLERANCE = 0.01  # the bar: every step's loss within 1% of the single-process run's


def _engine_losses(parallel, rank):
    from turbotrain import Config, Engine

    wl = workload()
    model = wl.build_model()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=LR), wl.loss_fn,
                    config=Config(parallel=parallel, device="cpu"))
    return [engine.step(batch if rank is None else rows(batch, rank)).loss.item()
            for batch in text_batches(n=STEPS)]


def sc_parity_fsdp(info, shared):
    from turbotrain.parallel import ParallelConfig

    return {"losses": _engine_losses(ParallelConfig(dp_shard=2), info["rank"])}


def sc_parity_tp_sp(info, shared):
    from turbotrain.parallel import ParallelConfig

    return {"losses": _engine_losses(ParallelConfig(dp_shard=1, tp=2, sequence_parallel=True), None)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(WORLD, [sc_parity_fsdp, sc_parity_tp_sp], tmp_path_factory.mktemp("parity"), {}, timeout_s=600)


@pytest.fixture(scope="module")
def single():
    torch.manual_seed(0)
    return reference(workload().build_model(), text_batches(n=STEPS), steps=STEPS)["losses"]


def _worst(got, want):
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    step = max(range(len(rel)), key=rel.__getitem__)
    return rel[step], step


@pytest.mark.parametrize("scenario", ["sc_parity_fsdp", "sc_parity_tp_sp"])
def test_100_steps_track_the_single_process_loss_within_1_percent(ranks, single, scenario):
    res = result(ranks, scenario)
    if scenario == "sc_parity_fsdp":
        losses = [sum(r["losses"][s] for r in res) / WORLD for s in range(STEPS)]
    else:
        assert res[0]["losses"] == res[1]["losses"]  # the pair computes one loss
        losses = res[0]["losses"]
    assert len(losses) == len(single) == STEPS
    worst, step = _worst(losses, single)
    print(f"{scenario}: worst step {step}, {worst:.2e} relative")  # shown with -s: the margin under the bar
    assert worst <= TOLERANCE, f"step {step}: {losses[step]:.5f} vs {single[step]:.5f} ({worst:.2%})"
    # and the run really trained: the last ten steps ~0.9 nats below ln(512) = 6.24 at the start
    assert sum(single[-10:]) / 10 < single[0] - 0.5
