"""Four-rank gloo tests of the 2-D meshes: HSDP (dp_replicate x dp_shard) and FSDP x tensor parallel.

Same harness as test_parallel_dist.py (one spawn, every scenario, a plain single-process oracle
here); four processes share two cores, so the model is tiny.
"""

from __future__ import annotations

import pytest
import torch

from test_parallel_dist import (
    assert_params_close, cfg, drive, full_params, reference, result, spawn, text_batches, train, workload,
)

pytestmark = pytest.mark.dist

WORLD = 4
TINY = dict(d=32, n_head=2, n_layer=2, T=16, B=4)


def _run(info, config, dp_rank, dp_world, checkpoint_to=None):
    from torch.distributed.tensor import DTensor

    from turbotrain.parallel import save_sharded

    model = workload(**TINY).build_model()
    t, plan, opt = drive(model, config)
    out = train(model, t, opt, text_batches(**TINY), rank=dp_rank, world=dp_world, clip=1e9)
    if checkpoint_to:
        save_sharded(checkpoint_to, model, opt, extra={"steps": len(out["losses"])})
    placements = {n: tuple(map(str, p.placements)) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return {**out, "params": full_params(model), "placements": placements, "describe": t.describe(),
            "mesh": tuple(t.mesh.mesh_dim_names)}


def sc_hsdp(info, shared):
    return _run(info, cfg(dp_replicate=2, dp_shard=2), info["rank"], 4)


def sc_replicate_only(info, shared):
    return _run(info, cfg(dp_replicate=4, dp_shard=1), info["rank"], 4)


def sc_fsdp_x_tp(info, shared):
    # Mesh (dp_shard=2, tp=2), rank = 2 * dp + tp: the two ranks of a tensor-parallel pair share rows.
    return _run(info, cfg(dp_shard=2, tp=2), info["rank"] // 2, 2)


def sc_fsdp_x_sp(info, shared):
    return _run(info, cfg(dp_shard=2, tp=2, sequence_parallel=True), info["rank"] // 2, 2,
                checkpoint_to=shared["fsdp_x_sp"])


SCENARIOS = [sc_hsdp, sc_replicate_only, sc_fsdp_x_tp, sc_fsdp_x_sp]


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("parallel_mesh")


@pytest.fixture(scope="module")
def ranks(shared_dir):
    return spawn(WORLD, SCENARIOS, shared_dir, {"fsdp_x_sp": str(shared_dir / "fsdp_x_sp")})


@pytest.fixture(scope="module")
def ref():
    torch.manual_seed(0)
    return reference(workload(**TINY).build_model(), text_batches(**TINY))


def _mean_losses(res, groups):
    """The global loss per step: the mean over data-parallel groups of one member's loss."""
    return [sum(res[g]["losses"][s] for g in groups) / len(groups) for s in range(len(res[0]["losses"]))]


@pytest.mark.parametrize("scenario, groups, mesh, placement", [
    ("sc_hsdp", [0, 1, 2, 3], ("dp_replicate", "dp_shard"), ("R", "S(0)")),
    ("sc_replicate_only", [0, 1, 2, 3], ("dp_replicate", "dp_shard"), ("R", "S(0)")),
])
def test_hsdp_and_replication_train_like_one_process(ranks, ref, scenario, groups, mesh, placement):
    res = result(ranks, scenario)
    torch.testing.assert_close(_mean_losses(res, groups), ref["losses"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res[0]["norms"], ref["norms"], rtol=1e-4, atol=1e-6)
    for r in res:
        assert r["mesh"] == mesh
        assert set(r["placements"].values()) == {placement}
        assert_params_close(r["params"], ref["params"])
    assert "HSDP" in res[0]["describe"] if scenario == "sc_hsdp" else "FSDP2" in res[0]["describe"]


@pytest.mark.parametrize("scenario", ["sc_fsdp_x_tp", "sc_fsdp_x_sp"])
def test_fsdp_times_tensor_parallel_trains_like_one_process(ranks, ref, scenario):
    res = result(ranks, scenario)
    for tp_rank in (0, 1):  # each member of a tensor-parallel pair reports its pair's loss
        torch.testing.assert_close(_mean_losses(res, [tp_rank, 2 + tp_rank]), ref["losses"], rtol=1e-5, atol=1e-6)
    for r in res:
        assert r["mesh"] == ("dp_shard", "tp")
        assert r["placements"]["blocks.0.attn.q_proj.weight"][1] == "S(0)"  # split by heads on tp
        assert r["placements"]["blocks.0.attn.out_proj.weight"][1] == "S(1)"
        torch.testing.assert_close(r["norms"], ref["norms"], rtol=1e-4, atol=1e-6)
        assert_params_close(r["params"], ref["params"])


def test_a_2d_checkpoint_consolidates_to_the_stock_model(ranks, shared_dir):
    from turbotrain.parallel import consolidate

    want = result(ranks, "sc_fsdp_x_sp")[0]["params"]
    consolidate(shared_dir / "fsdp_x_sp", shared_dir / "out.pt")
    plain = workload(**TINY).build_model()
    plain.load_state_dict(torch.load(shared_dir / "out.pt", weights_only=True))
    assert_params_close(dict(plain.named_parameters()), want, rtol=0, atol=0)
