"""Two-rank gloo tests of turbotrain.comm, each compared with the single-process twins in comm/reference.py.

One spawn of two processes runs every scenario (starting torch twice per test would cost more
than the tests); each rank saves what it saw, and the tests below compare ranks and references.
The ranks start from Open MPI variables, which is also the MPI-style init test.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from turbotrain.comm.reference import ReferencePowerSGD, cast_mean, exact_mean, reference_onebit_mean

pytestmark = pytest.mark.dist

WORLD = 2
TIMEOUT_S = 90


class Fixed(nn.Module):
    """loss = <w, cw> + <b, cb>: the gradient is exactly (cw, cb), whatever the parameters are."""

    def __init__(self, rows=33, cols=17):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(rows, cols))
        self.b = nn.Parameter(torch.zeros(cols))

    def forward(self, cw, cb):
        return (self.w * cw).sum() + (self.b * cb).sum()


def _grads(rank, rows, cols, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(rows, cols, generator=g), torch.randn(cols, generator=g)


def _dp(**kw):
    from turbotrain.comm import DataParallelConfig

    return DataParallelConfig(**kw)


def _prepare(model, dp, opt=None):
    from turbotrain import comm

    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    return comm.prepare(model, opt, dp, torch.device("cpu"))


# -- scenarios: each runs on both ranks and returns what the tests check -----------------------
def sc_info(info):
    return {"info": (info.rank, info.world_size, info.local_rank, info.backend, str(info.device), info.launcher)}


def sc_cast(info):
    out = {}
    for comp in ("bf16", "fp16"):
        ddp, _, state = _prepare(Fixed(), _dp(compression=comp, bucket_mb=0.001))
        cw, cb = _grads(info.rank, 33, 17)
        ddp(cw, cb).backward()
        out[comp] = {"local": (cw, cb), "synced": (ddp.module.w.grad.clone(), ddp.module.b.grad.clone()),
                     "rounds": state.collective_count, "calls": state.collective_calls}
    return out


def sc_accumulate(info):
    # w is 1.2 MB, over DDP's 1 MiB first-bucket cap: b and w land in two buckets.
    ddp, opt, state = _prepare(Fixed(600, 500), _dp(bucket_mb=0.001))
    counts, calls, synced, local = [], [], [], []
    for step in range(2):
        total = torch.zeros(600, 500)
        for micro in range(3):
            cw, cb = _grads(info.rank, 600, 500, seed=10 * step + micro)
            total += cw
            if micro < 2:
                with state.no_sync():
                    ddp(cw, cb).backward()
            else:
                ddp(cw, cb).backward()
            counts.append(state.collective_count)
            calls.append(state.collective_calls)
        synced.append(ddp.module.w.grad.clone())
        local.append(total)
        opt.zero_grad(set_to_none=True)
    return {"counts": counts, "synced": synced, "local": local, "calls": calls}


STEPS_PSGD = 42  # 2 exact warm-up steps, then 40 compressed


def sc_powersgd(info):
    from turbotrain.comm.powersgd import initial_q

    ddp, _, state = _prepare(Fixed(64, 48), _dp(compression="powersgd", powersgd_rank=4, warmup_steps=2))
    cw, cb = _grads(info.rank, 64, 48)
    outs = []
    for _ in range(STEPS_PSGD):
        ddp(cw, cb).backward()
        outs.append((ddp.module.w.grad.clone(), ddp.module.b.grad.clone()))
        ddp.module.zero_grad(set_to_none=True)
    sd = state.state_dict()
    return {"local": (cw, cb), "outs": outs, "error": sd["hook"]["errors"]["w"], "q0": initial_q("w", 48, 4),
            "rounds": state.collective_count, "sd_keys": sorted(sd["hook"])}


def sc_onebit(info):
    from turbotrain.comm import OneBitAdam

    model = Fixed(40, 30)
    opt = OneBitAdam(model.parameters(), lr=0.01, warmup_steps=2)
    ddp, opt, state = _prepare(model, _dp(compression="onebit", warmup_steps=2), opt)
    cw, cb = _grads(info.rank, 40, 30)
    rec = []
    for _ in range(6):
        ddp(cw, cb).backward()
        grad = ddp.module.w.grad.clone()
        opt.step()
        rec.append({"grad": grad, "m_w": opt.state[model.w]["exp_avg"].clone(),
                    "m_b": opt.state[model.b]["exp_avg"].clone(), "w": model.w.detach().clone(),
                    "rounds": state.collective_count})
        opt.zero_grad(set_to_none=True)
    sd = state.state_dict()
    return {"local": (cw, cb), "rec": rec, "has_errors": sd["onebit"]["worker_error"] is not None}


def sc_onebit_exchange(info):
    from turbotrain.comm.onebit import OneBitCompressor

    comp = OneBitCompressor()
    g = torch.Generator().manual_seed(info.rank)
    x = torch.randn(101, generator=g)  # odd length: padding to whole bytes per server chunk
    return {"x": x, "outs": [comp.exchange(x, [60, 41]) for _ in range(30)]}


def sc_preflight(info):
    from turbotrain import comm
    from turbotrain.errors import DistributedError

    comm.preflight({"compression": None, "world": 2})  # agreeing plans pass
    plan = {"compression": "bf16" if info.rank == 1 else None, "world": 2}
    try:
        comm.preflight(plan)
    except DistributedError as exc:
        return {"error": str(exc)}
    return {"error": None}


def sc_found_inf(info):
    _, _, state = _prepare(Fixed(), _dp())
    flag = torch.tensor(1.0 if info.rank == 0 else 0.0)
    loss = state.average_scalar(torch.tensor(float(info.rank)))
    return {"agreed": state.agree_found_inf(flag).item(), "mean": loss.item()}


def sc_sync_bn(info):
    from turbotrain.errors import HardwareError

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ddp, _, _ = _prepare(model, _dp(sync_bn=False))
    kept = type(ddp.module[1]).__name__
    try:
        _prepare(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), _dp(sync_bn=True))
        err = None
    except HardwareError as exc:
        err = str(exc)
    return {"kept": kept, "sync_error": err}


class EmbedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.head = nn.Linear(6, 3)

    def forward(self, idx):
        return self.head(self.emb(idx)).pow(2).mean()


def sc_sparse(info):
    import copy

    torch.manual_seed(0)
    model = EmbedNet()
    local = copy.deepcopy(model)
    ddp, _, state = _prepare(model, _dp(sparse_embeddings=True))
    g = torch.Generator().manual_seed(info.rank)
    batches = [torch.randint(0, 20, (5,), generator=g) for _ in range(2)]
    with state.no_sync():
        ddp(batches[0]).backward()
    ddp(batches[1]).backward()
    for idx in batches:
        local(idx).backward()
    return {"emb": model.emb.weight.grad.to_dense(), "head": model.head.weight.grad.clone(),
            "local_emb": local.emb.weight.grad.to_dense(), "local_head": local.head.weight.grad.clone(),
            "rounds": state.collective_count}


def sc_engine(info):
    from turbotrain import Config, Engine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, opt, nn.functional.cross_entropy, config=Config(data_parallel=True, accumulate=2, device="cpu"))
    g = torch.Generator().manual_seed(100 + info.rank)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(4)]
    for b in batches:
        engine.step(b)
    return {"init": init, "batches": batches, "final": {k: v.clone() for k, v in engine.module.state_dict().items()},
            "rounds": engine.comm.collective_count, "steps": engine.steps}


def sc_engine_master(info):
    from turbotrain import Config, Engine

    torch.manual_seed(info.rank)  # each rank initialises differently, as an unseeded user model would
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine(model, opt, nn.functional.cross_entropy,
                    config=Config(data_parallel=True, precision="bf16-master", device="cpu"))
    g = torch.Generator().manual_seed(100 + info.rank)
    for _ in range(3):
        engine.step((torch.randn(8, 8, generator=g), torch.randint(0, 8, (8,), generator=g)))
    return {"masters": [m.detach().clone() for m in engine.precision.master_params],
            "model": [p.detach().clone() for p in engine.module.parameters()]}


SCENARIOS = [sc_info, sc_cast, sc_accumulate, sc_powersgd, sc_onebit, sc_onebit_exchange, sc_preflight,
             sc_found_inf, sc_sync_bn, sc_sparse, sc_engine, sc_engine_master]


def _worker(rank, port, out_dir):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(var, None)
    os.environ.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(WORLD),
                      OMPI_COMM_WORLD_LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from turbotrain import comm

    info = comm.init(backend="gloo", timeout_s=60)
    assert comm.init() == info  # idempotent
    results = {}
    for scenario in SCENARIOS:
        try:
            results[scenario.__name__] = scenario(info)
        except Exception:  # recorded, so one broken scenario does not hide the others
            results[scenario.__name__] = {"exception": traceback.format_exc()}
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm_dist")
    ctx = mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"2-rank gloo run did not finish within {TIMEOUT_S} s (a collective hung)")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def result(ranks, name):
    per_rank = [r[name] for r in ranks]
    for r in per_rank:
        if "exception" in r:
            pytest.fail(r["exception"])
    return per_rank


# -- tests --------------------------------------------------------------------------------------
def test_mpi_style_env_init(ranks):
    infos = [r["info"] for r in result(ranks, "sc_info")]
    assert infos == [(0, 2, 0, "gloo", "cpu", "mpi"), (1, 2, 1, "gloo", "cpu", "mpi")]


# Machine epsilon of each wire dtype: one rounding of a value is at most eps/2 of it.
WIRE_EPS = {"bf16": 2.0**-7, "fp16": 2.0**-10}
WIRE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("comp", ["bf16", "fp16"])
def test_cast_compression_matches_exact_mean_within_wire_precision(ranks, comp):
    res = [r[comp] for r in result(ranks, "sc_cast")]
    for i in range(2):  # w (33 x 17, odd) and b
        locals_ = [r["local"][i] for r in res]
        got = [r["synced"][i] for r in res]
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)  # every rank applies the same update
        exact = exact_mean(locals_).float()
        # n inputs rounded once each plus (n-1) rounded additions, each <= eps/2 of sum(|g_i|)/n.
        bound = WIRE_EPS[comp] / 2 * WORLD * torch.stack([t.abs() for t in locals_]).sum(0) / WORLD + 1e-7
        assert ((got[0] - exact).abs() <= bound).all()
        # And it is the twin's result to one wire ulp (gloo may add in a wider type).
        twin = cast_mean(locals_, WIRE_DTYPE[comp])
        torch.testing.assert_close(got[0], twin, rtol=WIRE_EPS[comp], atol=1e-7)
    assert res[0]["rounds"] == 1


def test_one_collective_round_per_accumulated_step(ranks):
    res = result(ranks, "sc_accumulate")
    assert res[0]["counts"] == [0, 0, 1, 1, 1, 2]
    calls = res[0]["calls"]
    assert calls[0] == calls[1] == 0 and calls[3] == calls[4] == calls[2]  # nothing sent under no_sync
    assert calls[5] > 2  # several buckets (DDP regroups them after its first iteration), still one round
    for step in range(2):
        expect = exact_mean([r["local"][step] for r in res]).float()
        for r in res:
            torch.testing.assert_close(r["synced"][step], expect, rtol=1e-6, atol=1e-6)


def test_powersgd_exact_in_warmup_then_matches_twin(ranks):
    res = result(ranks, "sc_powersgd")
    assert res[0]["rounds"] == STEPS_PSGD and {"qs", "errors"} <= set(res[0]["sd_keys"])
    w_locals = [r["local"][0] for r in res]
    b_exact = exact_mean([r["local"][1] for r in res]).float()
    twin = ReferencePowerSGD(WORLD, rank=4, warmup_steps=2, q0=res[0]["q0"])
    for step in range(STEPS_PSGD):
        expect = twin.step(w_locals)
        for r in res:
            w, b = r["outs"][step]
            # fp32 sums of 64x48 products in a different order: 1e-5 relative.
            torch.testing.assert_close(w, expect, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(b, b_exact, rtol=1e-6, atol=1e-6)  # biases stay exact
        if step < 2:
            torch.testing.assert_close(res[0]["outs"][step][0], exact_mean(w_locals).float(), rtol=1e-6, atol=1e-6)


def test_powersgd_error_feedback_drives_accumulated_error_down(ranks):
    res = result(ranks, "sc_powersgd")
    mean = exact_mean([r["local"][0] for r in res]).float()
    compressed = [res[0]["outs"][k][0] for k in range(2, STEPS_PSGD)]
    assert (compressed[0] - mean).norm() > 0.05 * mean.norm()  # rank 4 of a full-rank 64x48 is lossy

    def accumulated_error(k):
        return ((sum(compressed[:k]) - k * mean).norm() / (k * mean.norm())).item()

    # Telescoping: what was sent plus what is still held back equals what was meant to be sent.
    held_back = exact_mean([r["error"] for r in res]).float()
    k = len(compressed)
    torch.testing.assert_close(sum(compressed) + held_back, k * mean, rtol=1e-4, atol=1e-4)
    # A flat-spectrum 64x48 needs ~12 rank-4 steps to send every direction once; after 40 the
    # accumulated error has to be well below the first step's (it falls like 1/k once bounded).
    assert accumulated_error(k) < accumulated_error(1) / 4


def test_onebit_exchange_matches_twin_and_error_feedback_converges(ranks):
    res = result(ranks, "sc_onebit_exchange")
    xs = [r["x"] for r in res]
    werr, serr = [torch.zeros(101) for _ in xs], [torch.zeros(56) for _ in xs]
    for step in range(30):
        expect = reference_onebit_mean(xs, [60, 41], werr, serr)
        for r in res:
            torch.testing.assert_close(r["outs"][step], expect, rtol=1e-6, atol=1e-6)
    mean = exact_mean(xs).float()
    outs = res[0]["outs"]

    def accumulated_error(k):
        return ((sum(outs[:k]) - k * mean).norm() / (k * mean.norm())).item()

    assert accumulated_error(1) > 0.2  # one bit per value is far from the mean
    assert accumulated_error(30) < accumulated_error(1) / 5


def test_onebit_adam_warmup_then_local_grads_and_shared_momentum(ranks):
    res = result(ranks, "sc_onebit")
    cws = [r["local"][0] for r in res]
    cbs = [r["local"][1] for r in res]
    # Twin: Adam on the exact mean for 2 steps, then momentum of local grads through the 1-bit mean.
    b1 = 0.9
    m_w, m_b = torch.zeros(40, 30), torch.zeros(30)
    werr, serr = [torch.zeros(1230) for _ in res], [torch.zeros(616) for _ in res]
    for step in range(6):
        for r in res:
            assert r["rec"][step]["rounds"] == step + 1  # one exchange per step, before and after warm-up
        if step < 2:
            for r in res:  # DDP averaged the gradients
                torch.testing.assert_close(r["rec"][step]["grad"], exact_mean(cws).float(), rtol=1e-6, atol=1e-6)
            m_w = b1 * m_w + (1 - b1) * exact_mean(cws).float()
            m_b = b1 * m_b + (1 - b1) * exact_mean(cbs).float()
        else:
            for r, cw in zip(res, cws):  # the no-op hook left the local gradient alone
                torch.testing.assert_close(r["rec"][step]["grad"], cw, rtol=0, atol=0)
            locals_ = [torch.cat([(b1 * m_w + (1 - b1) * cw).reshape(-1), b1 * m_b + (1 - b1) * cb])
                       for cw, cb in zip(cws, cbs)]
            synced = reference_onebit_mean(locals_, [1200, 30], werr, serr)
            m_w, m_b = synced[:1200].view(40, 30), synced[1200:]
        for r in res:
            torch.testing.assert_close(r["rec"][step]["m_w"], m_w, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r["rec"][step]["m_b"], m_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res[0]["rec"][-1]["w"], res[1]["rec"][-1]["w"], rtol=0, atol=0)
    assert res[0]["has_errors"]


def test_preflight_mismatch_raises_on_every_rank_naming_the_rank(ranks):
    for r in result(ranks, "sc_preflight"):
        assert r["error"] is not None
        assert "rank 1 differs from rank 0" in r["error"] and "compression" in r["error"]


def test_ranks_agree_on_skip_when_one_rank_has_inf(ranks):
    res = result(ranks, "sc_found_inf")
    assert [r["agreed"] for r in res] == [1.0, 1.0]
    assert [r["mean"] for r in res] == [0.5, 0.5]


def test_sync_bn_only_when_asked(ranks):
    for r in result(ranks, "sc_sync_bn"):
        assert r["kept"] == "BatchNorm1d"
        assert r["sync_error"] is not None and "sync_bn" in r["sync_error"]


def test_sparse_embedding_grads_are_averaged_sparsely(ranks):
    res = result(ranks, "sc_sparse")
    expect_emb = exact_mean([r["local_emb"] for r in res]).float()
    expect_head = exact_mean([r["local_head"] for r in res]).float()
    for r in res:
        torch.testing.assert_close(r["emb"], expect_emb, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["head"], expect_head, rtol=1e-6, atol=1e-7)
        assert r["rounds"] == 1
    assert not torch.equal(res[0]["local_emb"], res[1]["local_emb"])  # the ranks did see different rows


def test_engine_data_parallel_equals_single_process_on_the_global_batch(ranks):
    res = result(ranks, "sc_engine")
    assert [r["rounds"] for r in res] == [2, 2] and res[0]["steps"] == 2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model.load_state_dict(res[0]["init"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for micro in range(2):
            # Mean loss per rank and micro-batch, averaged over both: the mean over all 4 x 6 samples.
            for r in res:
                x, y = r["batches"][2 * step + micro]
                (nn.functional.cross_entropy(model(x), y) / 4).backward()
        opt.step()
        opt.zero_grad()
    for key, value in model.state_dict().items():
        for r in res:
            torch.testing.assert_close(r["final"][key], value, rtol=1e-5, atol=1e-6)


def test_bf16_master_replicas_stay_identical_from_different_inits(ranks):
    res = result(ranks, "sc_engine_master")
    for a, b in zip(res[0]["masters"], res[1]["masters"]):
        assert torch.equal(a, b)  # FP32 masters were broadcast with DDP's weights
    for a, b in zip(res[0]["model"], res[1]["model"]):
        assert torch.equal(a, b)
