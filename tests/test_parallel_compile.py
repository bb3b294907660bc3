"""compile=True on a sharded Engine: FSDP2 (dp_shard=2) and tensor + sequence parallel (tp=2), 2 gloo ranks.

Each rank trains the same model twice through the Engine, compiled and not, on the same rows; the
uncompiled sharded run is the reference (its own parity with one plain process is
test_parallel_dist's and test_parallel_parity's). Spawned with test_parallel_dist's helpers.
"""

from __future__ import annotations

import pytest
import torch

from test_parallel_dist import LR, WORLD, cfg, result, rows, spawn, text_batches, workload

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 4
COMPILE_TIMEOUT_S = 540  # Inductor builds its C++ kernels on the shared cores at the first step

# Inductor fuses the pointwise ops and reductions (norms, softmax, the loss) into kernels of its own,
# which sum in another order than eager: the first loss differs in the last fp32 bits, and AdamW
# (dividing each update by the gradient's running RMS) carries such bits forward step by step.
COMPILED_VS_EAGER = dict(rtol=1e-5, atol=1e-6)


def _losses(parallel, rank, compile):
    from turbotrain import Config, Engine

    torch.manual_seed(0)
    wl = workload()
    model = wl.build_model()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=LR), wl.loss_fn,
                    config=Config(parallel=parallel, compile=compile, device="cpu"))
    stats = [engine.step(batch if rank is None else rows(batch, rank)) for batch in text_batches(n=STEPS)]
    return {"losses": [s.loss.item() for s in stats], "recompiles": [s.recompiles for s in stats]}


def _compiled_and_eager(parallel, rank):
    torch._dynamo.reset()  # graphs of an earlier scenario in this process do not count against this one
    from turbotrain.fusion.compile import recompile_count

    compiled = _losses(parallel, rank, compile=True)
    graphs = recompile_count()
    return {"compiled": compiled, "graphs": graphs, "eager": _losses(parallel, rank, compile=False)}


def sc_compile_fsdp(info, shared):
    return _compiled_and_eager(cfg(dp_shard=2), info["rank"])  # each rank its half of the rows


def sc_compile_tp_sp(info, shared):
    return _compiled_and_eager(cfg(tp=2, sequence_parallel=True), None)  # a tensor-parallel pair shares its rows


@pytest.fixture(scope="module")
def compiled_ranks(tmp_path_factory):
    return spawn(WORLD, [sc_compile_fsdp, sc_compile_tp_sp], tmp_path_factory.mktemp("parallel_compile"), {},
                 timeout_s=COMPILE_TIMEOUT_S)


@pytest.mark.parametrize("name", ["sc_compile_fsdp", "sc_compile_tp_sp"])
def test_compiled_sharded_engine_trains_like_the_uncompiled_one(compiled_ranks, name):
    for r in result(compiled_ranks, name):
        assert r["graphs"] > 0  # Dynamo did compile the forward and loss
        torch.testing.assert_close(r["compiled"]["losses"], r["eager"]["losses"], **COMPILED_VS_EAGER)
        assert r["compiled"]["recompiles"] == [0] * STEPS  # stable shapes: no graph after the first step
        assert not [w for w in r["warnings"] if "returned a view tensor" in w]
