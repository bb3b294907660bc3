"""The parameter-server and hybrid strategies on three gloo ranks (two servers and a pure worker).

Both are checked against the exact mean of the ranks' gradients (comm/reference.exact_mean), and
their byte counters against what the topology must send. Spawning uses test_comm_dist.run_ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from test_comm_dist import EmbedNet, Params, _dp, _prepare, result, run_ranks
from turbotrain.comm import DataParallelConfig
from turbotrain.comm.reference import exact_mean
from turbotrain.comm.strategies import shard_bounds
from turbotrain.errors import ConfigError

WORLD = 3
SHAPES = [(33, 17), (17,), (300, 200)]  # an odd matrix, a bias, and one big enough for its own bucket
CASES = [(1, None), (2, None), (3, None), (2, "bf16")]


def _grads(rank, step):
    g = torch.Generator().manual_seed(10 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def sc_parameter_server(info):
    out = {}
    for servers, comp in CASES:
        model = Params(*SHAPES)
        ddp, _, state = _prepare(model, _dp(strategy="parameter_server", ps_servers=servers, compression=comp,
                                            bucket_mb=0.1))
        steps = []
        for step in range(2):  # the second runs on the buckets DDP rebuilt after the first
            before = state.bytes_sent
            ddp(*_grads(info.rank, step)).backward()
            steps.append({"grads": [p.grad.clone() for p in model.parameters()], "bytes": state.bytes_sent - before})
            model.zero_grad(set_to_none=True)
        out[(servers, comp)] = {"steps": steps, "rounds": state.collective_count}
    return out


def sc_hybrid(info):
    import copy

    out = {}
    for strategy, servers in (("hybrid", 2), ("parameter_server", 1), ("hybrid", 3)):
        torch.manual_seed(0)
        model = EmbedNet()
        local = copy.deepcopy(model)
        ddp, _, state = _prepare(model, _dp(strategy=strategy, ps_servers=servers, sparse_embeddings=True))
        g = torch.Generator().manual_seed(info.rank)
        batches = [torch.randint(0, 20, (5,), generator=g) for _ in range(2)]
        with state.no_sync():
            ddp(batches[0]).backward()
        ddp(batches[1]).backward()
        for idx in batches:
            local(idx).backward()
        out[(strategy, servers)] = {
            "emb": model.emb.weight.grad.to_dense(), "head": model.head.weight.grad.clone(),
            "local_emb": local.emb.weight.grad.to_dense(), "local_head": local.head.weight.grad.clone(),
            "rounds": state.collective_count}
    return out


class SparseThenWide(nn.Module):
    """A sparse embedding (exchanged by the servers) feeding a layer big enough for 1-bit Adam."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.out = nn.Linear(8, 600)

    def forward(self, idx):
        return self.out(self.emb(idx)).pow(2).mean()


def sc_onebit_hybrid(info):
    from turbotrain.comm import OneBitAdam

    torch.manual_seed(0)
    model = SparseThenWide()
    opt = OneBitAdam(model.parameters(), lr=1e-2, warmup_steps=2)
    ddp, opt, state = _prepare(model, _dp(strategy="hybrid", ps_servers=2, sparse_embeddings=True,
                                          compression="onebit"), opt)
    g = torch.Generator().manual_seed(info.rank)
    for _ in range(5):
        ddp(torch.randint(0, 50, (7,), generator=g)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": [p.detach().clone() for p in model.parameters()],
            "compressed": [opt.compresses(p) for p in model.parameters()]}


def sc_too_many_servers(info):
    try:
        _prepare(Params((4, 4)), _dp(strategy="parameter_server", ps_servers=4))
    except ConfigError as exc:
        return {"error": str(exc)}
    return {"error": None}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("comm_strategies"),
                     [sc_parameter_server, sc_hybrid, sc_onebit_hybrid, sc_too_many_servers], world=WORLD)


pytestmark = pytest.mark.dist


@pytest.mark.parametrize("servers, comp", CASES)
def test_parameter_server_averages_exactly(ranks, servers, comp):
    res = [r[(servers, comp)] for r in result(ranks, "sc_parameter_server")]
    for step in range(2):
        for k in range(len(SHAPES)):
            locals_ = [_grads(rank, step)[k] for rank in range(WORLD)]
            got = [r["steps"][step]["grads"][k] for r in res]
            for g in got[1:]:
                assert torch.equal(g, got[0])  # every rank holds the servers' result
            if comp is None:
                torch.testing.assert_close(got[0], exact_mean(locals_).float(), rtol=1e-6, atol=1e-6)
            else:
                # n inputs g/n rounded to bf16 once each, n-1 rounded additions on the server: each
                # rounding is at most eps/2 of sum(|g_i|)/n (eps = 2^-7 for bf16's 8-bit mantissa)
                bound = 2.0**-8 * (2 * WORLD - 1) * torch.stack(locals_).abs().sum(0) / WORLD + 1e-7
                assert ((got[0] - exact_mean(locals_).float()).abs() <= bound).all()
    assert res[0]["rounds"] == 2


@pytest.mark.parametrize("servers, comp", CASES)
def test_parameter_server_bytes_are_pushes_plus_each_servers_pull(ranks, servers, comp):
    res = [r[(servers, comp)] for r in result(ranks, "sc_parameter_server")]
    elem = 2 if comp == "bf16" else 4
    total = sum(torch.Size(s).numel() for s in SHAPES)
    # the last step's buckets (DDP rebuilt them after the first); each rank pushes all of every bucket,
    # server s also pulls its shard of each: at most total/servers + one rounding per bucket
    for rank, r in enumerate(res):
        sent = r["steps"][1]["bytes"]
        if rank >= servers:
            assert sent == total * elem
        else:
            assert total * elem < sent <= total * elem + (total // servers + 3) * elem


def test_sparse_gradients_go_through_the_servers_and_average_exactly(ranks):
    for key in (("hybrid", 2), ("parameter_server", 1), ("hybrid", 3)):
        res = [r[key] for r in result(ranks, "sc_hybrid")]
        expect_emb = exact_mean([r["local_emb"] for r in res]).float()
        expect_head = exact_mean([r["local_head"] for r in res]).float()
        for r in res:
            torch.testing.assert_close(r["emb"], expect_emb, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(r["head"], expect_head, rtol=1e-6, atol=1e-7)
            assert r["rounds"] == 1


def test_onebit_adam_with_sparse_embeddings_through_the_servers(ranks):
    res = result(ranks, "sc_onebit_hybrid")
    assert res[0]["compressed"] == [False, True, False]  # the sparse embedding stays exact, the 600 x 8 goes 1-bit
    for r in res[1:]:
        for a, b in zip(r["params"], res[0]["params"]):
            assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in res[0]["params"])


def test_more_servers_than_ranks_is_refused(ranks):
    for r in result(ranks, "sc_too_many_servers"):
        assert r["error"] is not None and "ps_servers=4" in r["error"] and "choose 1..3" in r["error"]


def test_strategy_is_validated():
    with pytest.raises(ConfigError, match="strategy='star' is not valid; choose one of: 'ring', 'parameter_server'"):
        DataParallelConfig(strategy="star")
    with pytest.raises(ConfigError, match="ps_servers"):
        DataParallelConfig(ps_servers=0)
    with pytest.raises(ConfigError, match="strategy='ring' or 'hybrid'"):
        DataParallelConfig(strategy="parameter_server", compression="powersgd")
    assert DataParallelConfig().strategy == "ring" and DataParallelConfig().ps_servers == 1


def test_shards_cover_the_bucket_once():
    for length in (0, 1, 7, 100, 101):
        for shards in (1, 2, 3, 8):
            bounds = shard_bounds(length, shards)
            assert len(bounds) <= shards
            covered = [i for a, b in bounds for i in range(a, b)]
            assert covered == list(range(length))
