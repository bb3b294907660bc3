"""Single-process tests of turbotrain.comm: launcher variables, NCCL presets, packing, twins."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from turbotrain.bench.comm_bench import bus_factor, parse_size, size_sweep
from turbotrain.comm import DataParallelConfig, OneBitAdam, convert_batchnorm, read_launch_env, to_onebit_adam
from turbotrain.comm.agree import _differences, plan_hash
from turbotrain.comm.hooks import HookState, cast_hook
from turbotrain.comm.nccl import apply_preset, format_env, preset_env, validate_nccl_env
from turbotrain.comm.onebit import OneBitCompressor, pack_signs, unpack_signs, warmup_for
from turbotrain.comm.powersgd import PowerSGDState, initial_q, powersgd_hook, should_compress
from turbotrain.comm.reference import ReferenceOneBitAdam, ReferencePowerSGD, reference_onebit_mean
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


NCCL_2_21, NCCL_2_23, NCCL_2_24 = (2, 21, 5), (2, 23, 4), (2, 24, 3)  # releases with and without the changes


@pytest.mark.parametrize("env, message", [
    ({"NCCL_NSOCKS_PERTHREAD": "8", "NCCL_SOCKET_NTHREADS": "16"}, "at most 64"),
    ({"NCCL_ALGO": "Ring,Fast"}, "'Fast' is not an NCCL algorithm"),
    ({"NCCL_ALGO": "Ring, Tree"}, "does not strip spaces"),
    ({"NCCL_PROTO": "LL256"}, "'LL256' is not an NCCL protocol; choose from LL, LL128, Simple"),
    ({"NCCL_BUFFSIZE": "4MB"}, "must be an integer"),
    ({"NCCL_BUFFSIZE": "1024"}, "out of range"),
    ({"NCCL_IB_DISABLE": "yes"}, "must be 0 or 1"),
    ({"NCCL_NET_GDR_LEVEL": "FAR"}, "PHB"),
])
def test_bad_nccl_values_are_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        validate_nccl_env(env, NCCL_2_24)


def test_nccl_algo_accepts_lists_negation_and_per_collective_form():
    for version in (NCCL_2_21, NCCL_2_24):
        validate_nccl_env({"NCCL_ALGO": "^Tree", "NCCL_PROTO": "^LL128"}, version)
        validate_nccl_env({"NCCL_ALGO": "ring,tree", "NCCL_PROTO": "LL,simple"}, version)
    validate_nccl_env({"NCCL_ALGO": "allreduce:tree"}, NCCL_2_24)
    validate_nccl_env({"NCCL_ALGO": "allreduce:tree,ring;allgather:ring"}, NCCL_2_24)
    validate_nccl_env({"NCCL_ALGO": "ring;allreduce:^tree", "NCCL_PROTO": "Simple;allreduce:^LL"}, NCCL_2_24)


@pytest.mark.parametrize("value", ["allreduce:tree,ring;allgather:ring", "allreduce:tree"])
def test_per_collective_lists_need_nccl_2_24(value):
    with pytest.raises(ConfigError, match="need NCCL >= 2.24, and this torch has NCCL 2.21.5"):
        validate_nccl_env({"NCCL_ALGO": value}, NCCL_2_21)
    with pytest.raises(ConfigError, match="NCCL >= 2.24"):
        validate_nccl_env({"NCCL_PROTO": "Simple;allreduce:LL"}, NCCL_2_21)


@pytest.mark.parametrize("value, message", [
    ("allreduce:tree;ring", "only the first entry"),
    ("allredux:tree", "'allredux' is not a collective"),
    ("allreduce:tree;allgather:Fast", "'Fast' is not an NCCL algorithm"),
])
def test_bad_per_collective_lists_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        validate_nccl_env({"NCCL_ALGO": value}, NCCL_2_24)


@pytest.mark.parametrize("algo, refused_by, message, accepted_by", [
    ("PAT", NCCL_2_21, "PAT needs NCCL >= 2.23", NCCL_2_23),
    ("NVLSTree", (2, 17, 1), "NVLSTree needs NCCL >= 2.18", (2, 18, 1)),
    ("CollNetDirect", (2, 12, 12), "CollNetDirect needs NCCL >= 2.14", NCCL_2_21),
    ("CollNet", NCCL_2_21, "CollNet needs NCCL < 2.14", (2, 12, 12)),
])
def test_nccl_algorithms_are_checked_against_the_nccl_release(algo, refused_by, message, accepted_by):
    with pytest.raises(ConfigError, match=message):
        validate_nccl_env({"NCCL_ALGO": f"Ring,{algo}"}, refused_by)
    validate_nccl_env({"NCCL_ALGO": f"Ring,{algo}"}, accepted_by)


def test_nccl_version_defaults_to_the_one_torch_has(monkeypatch):
    from turbotrain.comm import nccl

    monkeypatch.setattr(nccl, "installed_nccl_version", lambda: NCCL_2_21)
    with pytest.raises(ConfigError, match="NCCL 2.21.5"):
        validate_nccl_env({"NCCL_ALGO": "PAT"})


def test_preset_applied_after_init_warns_once(monkeypatch):
    from turbotrain.comm import nccl

    for key in preset_env("ethernet"):
        monkeypatch.delenv(key, raising=False)  # and restored, whatever apply_preset sets
    monkeypatch.setattr(nccl, "_LATE_WARNED", [False])
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_preset("ethernet", environ={})  # a child's environment: never too late
    with pytest.warns(RuntimeWarning, match="before init_process_group"):
        apply_preset("ethernet", nccl_version=NCCL_2_24)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_preset("ethernet", nccl_version=NCCL_2_24)  # said once is enough


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


def test_signs_pack_into_a_strided_slice_of_a_send_buffer():
    x = torch.randn(2 * 64)
    send = torch.zeros(2, 8 + 4, dtype=torch.uint8)  # per row: 8 sign bytes, then a 4-byte scale
    pack_signs(x, out=send[:, :8])
    assert torch.equal(send[:, :8].reshape(-1), pack_signs(x)) and not send[:, 8:].any()


def test_single_process_onebit_exchange_is_the_twin_with_one_rank():
    comp = OneBitCompressor()
    x = torch.randn(37)
    masked = torch.tensor([3, 30])
    werr, serr = [torch.zeros(37)], torch.zeros(37)
    for _ in range(3):
        got = comp.exchange(x, [20, 17], masked)
        torch.testing.assert_close(got, reference_onebit_mean([x], [20, 17], werr, serr, masked))
    kept = torch.ones(37, dtype=torch.bool)
    kept[masked] = False  # the errors' masked positions are don't-cares, zeroed before each use
    torch.testing.assert_close(comp.worker_error[:37][kept], werr[0][kept])
    assert got[masked].eq(0).all()


def test_masked_elements_split_into_whole_rows_and_single_elements():
    from turbotrain.comm.onebit import _Masked

    shape = torch.Size([6, 4])
    flat = torch.tensor([4, 5, 6, 7, 9, 16, 17, 18, 19, 23])  # rows 1 and 4 whole, then 9 and 23 alone
    m = _Masked.of(flat, shape)
    assert m.rows.tolist() == [1, 4] and m.elems.tolist() == [9, 23] and m.numel == flat.numel()
    t = torch.arange(24.0).view(shape)
    values = m.taken(t)
    assert sorted(values.tolist()) == flat.float().tolist()
    out = torch.zeros(shape)
    m.put_(out, values)
    assert torch.equal(out.view(-1)[flat], t.view(-1)[flat]) and out.view(-1).count_nonzero() == flat.numel()


class _Mirror:
    """A two-rank stand-in for OneBitCompressor whose other rank sends exactly what this one does."""

    world, group = 2, None

    def __init__(self):
        self.sent = 0

    def _all_gather(self, t):
        self.sent += t.numel() * t.element_size()
        return torch.cat([t, t])

    def _count(self, nbytes):
        self.sent += nbytes


@pytest.mark.parametrize("touched", [0, 1, 7])
def test_masked_gradients_are_summed_from_their_nonzero_blocks(touched):
    from turbotrain.comm.onebit import _BLOCK, _sparse_or_dense_sum

    values = torch.zeros(40 * _BLOCK)
    for b in range(touched):
        values[b * 5 * _BLOCK + 3] = b + 1.0  # one nonzero in each of `touched` blocks
    comp = _Mirror()
    got = _sparse_or_dense_sum(values.clone(), values.numel(), comp)
    assert torch.equal(got, 2 * values)  # both ranks' blocks, summed
    # an 8-byte count, then (id + 32 values) x 4 bytes per touched block; nothing when none is
    assert comp.sent == 8 + touched * (_BLOCK + 1) * 4


def test_onebit_pipelined_parts_change_no_bit():
    sizes, mask = [300, 1000, 77], torch.tensor([5, 400, 1376])  # pieces cut by parts, masked ends
    whole, split = OneBitCompressor(parts=1), OneBitCompressor(parts=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):  # the errors carry over: every step's input differs
        x = torch.randn(sum(sizes), generator=g)
        assert torch.equal(whole.exchange(x, sizes, mask), split.exchange(x, sizes, mask))
    assert len(whole._layout.parts) == 1 and len(split._layout.parts) == 3
    assert torch.equal(whole.worker_error, split.worker_error) and torch.equal(whole.server_error, split.server_error)


def test_onebit_adam_is_the_same_with_a_pipelined_exchange():
    params = [[nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1))) for s in ONEBIT_SHAPES]
              for _ in range(2)]
    opts = [OneBitAdam(ps, lr=1e-2, weight_decay=0.1, warmup_steps=3) for ps in params]
    opts[1].compressor.parts = 4
    for opt, ps in zip(opts, params):
        _onebit_run(opt, ps, 8)
    assert len(opts[1].compressor._layout.parts) == 4
    for a, b in zip(*params):
        assert torch.equal(a, b)


def test_onebit_compiled_kernels_match_the_eager_steps():
    sizes, mask = [300, 1000, 77], torch.tensor([5, 400, 1376])
    eager, fused = OneBitCompressor(parts=2, compile_kernels=False), OneBitCompressor(parts=2, compile_kernels=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(sum(sizes), generator=g)
        assert torch.equal(eager.exchange(x, sizes, mask), fused.exchange(x, sizes, mask))
    assert fused._compiled and not eager._compiled  # the kernels ran: no compile failure fell back
    assert torch.equal(eager.worker_error, fused.worker_error) and torch.equal(eager.server_error, fused.server_error)
    params = [[nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1))) for s in ONEBIT_SHAPES]
              for _ in range(2)]
    opts = [OneBitAdam(ps, lr=1e-2, weight_decay=0.1, warmup_steps=3) for ps in params]
    for opt, flag in zip(opts, (False, True)):
        opt.compressor.compile_kernels = flag
    for opt, ps in zip(opts, params):
        _onebit_run(opt, ps, 6)
    assert opts[1].compressor._compiled
    for a, b in zip(*params):
        # the residuals are bitwise the same; the fused update rounds p * decay + alpha * step once
        # less or more than the eager mul_ then add_: an ulp per step at most
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_onebit_kernels_run_eagerly_after_one_warning_where_compile_fails(monkeypatch):
    from turbotrain.comm import onebit_kernels

    def no_compiler(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(onebit_kernels, "_COMPILED", {})
    monkeypatch.setattr(onebit_kernels, "_COMPILE_FAILED", [])
    monkeypatch.setattr(torch, "compile", no_compiler)
    sizes = [300, 1000, 77]
    eager, fused = OneBitCompressor(compile_kernels=False), OneBitCompressor(compile_kernels=True)
    x = torch.randn(sum(sizes))
    with pytest.warns(RuntimeWarning, match="torch.compile of its kernels failed"):
        got = fused.exchange(x, sizes)
    assert torch.equal(got, eager.exchange(x, sizes)) and not fused._compiled


def test_onebit_exchange_lays_out_once(monkeypatch):
    from turbotrain.comm import onebit_exchange

    built = []
    original = onebit_exchange._build_layout
    monkeypatch.setattr(onebit_exchange, "_build_layout", lambda *a: built.append(1) or original(*a))
    comp = OneBitCompressor()
    padded = comp.configure([5000, 300], None, "cpu")
    buf = torch.randn(padded)
    for _ in range(3):
        comp.allreduce_(buf)
        assert comp.configure([5000, 300], None, "cpu") == padded
    assert built == [1]


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


ONEBIT_SHAPES = [(64, 80), (80,), (10, 12), (128, 40)]  # compressed, bias, small matrix, compressed


def _onebit_run(opt, params, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        if opt.steps_done < opt.warmup_steps:
            grads[0][:5] = 0  # rows untouched during warm-up: v = 0 at the freeze
        for p, grad in zip(params, grads):
            p.grad = grad
        opt.step()
        out.append(grads)
    return out


def test_onebit_adam_in_one_process_is_the_papers_algorithm():
    params = [nn.Parameter(torch.randn(s)) for s in ONEBIT_SHAPES]
    twin = ReferenceOneBitAdam([p.detach() for p in params], 1, lr=1e-2, weight_decay=0.1, warmup_steps=3)
    opt = OneBitAdam(params, lr=1e-2, weight_decay=0.1, warmup_steps=3)
    g = torch.Generator().manual_seed(0)
    for step in range(10):
        grads = [torch.randn(s, generator=g) for s in ONEBIT_SHAPES]
        if step < 3:
            grads[0][:5] = 0
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt.step()
        for got, want in zip(params, twin.step([grads])):
            torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)  # fp32, other op order
    assert set(opt._exact_idx) == {0} and opt._exact_idx[0].numel() == 5 * 80
    assert not opt.compresses(params[1]) and opt.compresses(params[3])


def test_onebit_state_dict_round_trips_into_a_fresh_optimizer():
    import copy

    params = [nn.Parameter(torch.randn(s)) for s in ONEBIT_SHAPES]
    opt = OneBitAdam(params, lr=1e-2, warmup_steps=3)
    _onebit_run(opt, params, 6)
    saved, weights = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    _onebit_run(opt, params, 3, seed=1)
    twins = [nn.Parameter(w) for w in weights]
    fresh = OneBitAdam(twins, lr=1e-2, warmup_steps=3)
    fresh.load_state_dict(saved)
    assert fresh.steps_done == 6 and fresh.compressing and set(fresh._exact_idx) == {0}
    _onebit_run(fresh, twins, 3, seed=1)
    for a, b in zip(params, twins):
        assert torch.equal(a, b)


def test_onebit_warmup_follows_the_papers_rule_of_thumb():
    p = nn.Parameter(torch.zeros(3))
    assert warmup_for(10_000) == 2000 and warmup_for(50) == 100  # 20% of the run, never under 100 steps
    assert OneBitAdam([p], total_steps=10_000).warmup_steps == 2000
    assert OneBitAdam([p]).warmup_steps == 1000
    assert OneBitAdam([p], warmup_steps=5, total_steps=10_000).warmup_steps == 5


class _Bucket:
    """What a DDP comm hook sees of a bucket: its flat buffer and its parameters."""

    def __init__(self, buffer, params):
        self._buffer, self._params = buffer, params

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def is_last(self):
        return True


class _Work:
    """A collective whose completion the test controls; waiting on it is what a hook must not do."""

    def __init__(self, tensor, world):
        self.tensor, self.world, self.fut = tensor, world, torch.futures.Future()

    def wait(self):
        raise AssertionError("the hook blocked on a collective")

    def get_future(self):
        return self.fut

    def complete(self):  # in place, as all_reduce is; every rank sent the same tensor: the sum is world x it
        self.fut.set_result([self.tensor.mul_(self.world)])


def _fake_collectives(monkeypatch, state):
    works = []

    def allreduce(tensor, group=None):
        state.count(tensor.numel() * tensor.element_size())
        works.append(_Work(tensor, state.world_size))
        return works[-1]

    monkeypatch.setattr(state, "allreduce", allreduce)
    return works


def test_bf16_cast_hook_reduces_a_bf16_bucket_in_place(monkeypatch):
    state = HookState(world_size=2, wire_dtype=torch.bfloat16)
    works = _fake_collectives(monkeypatch, state)
    buffer = torch.randn(10).to(torch.bfloat16)
    expect = buffer / 2
    fut = cast_hook(state, _Bucket(buffer, []))
    assert works[0].tensor is buffer  # no cast, no copy: the bucket itself goes on the wire
    torch.testing.assert_close(buffer, expect, rtol=0, atol=0)  # divided in place
    works[0].complete()
    assert fut.wait() is buffer and state.bytes_sent == 20


def test_powersgd_hook_returns_before_its_collectives_finish(monkeypatch):
    w, b = nn.Parameter(torch.zeros(64, 48)), nn.Parameter(torch.zeros(48))
    state = PowerSGDState(world_size=2, rank=4, warmup_steps=0, names={id(w): "w", id(b): "b"})
    works = _fake_collectives(monkeypatch, state)
    grad_w, grad_b = torch.randn(64, 48), torch.randn(48)
    buffer = torch.cat([grad_w.reshape(-1), grad_b])
    fut = powersgd_hook(state, _Bucket(buffer, [w, b]))
    assert len(works) == 1 and not fut.done()  # P is on its way; backward goes on
    works[0].complete()
    assert len(works) == 2 and not fut.done()  # Q launched from P's completion, not from the hook
    works[1].complete()
    assert fut.done() and fut.value() is buffer
    # both ranks sent the same gradient: the twin's mean of [g, g]
    twin = ReferencePowerSGD(2, rank=4, warmup_steps=0, q0=initial_q("w", 48, 4))
    torch.testing.assert_close(buffer[:64 * 48].view(64, 48), twin.step([grad_w, grad_w]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(buffer[64 * 48:], grad_b, rtol=1e-6, atol=1e-6)


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


def test_sync_bn_reduces_over_the_group_it_was_given(monkeypatch):
    from turbotrain.comm import ddp

    subgroup = object()  # stands in for a dist.new_group(...) handle; conversion does not touch it
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    assert convert_batchnorm(model, DataParallelConfig(sync_bn=True), subgroup)[1].process_group is subgroup
    # and prepare(group=...) hands its group down (stopped right after, before any collective)
    seen = []

    def record(model, dp, group=None):
        seen.append(group)
        raise StopIteration

    monkeypatch.setattr(ddp, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(ddp, "convert_batchnorm", record)
    with pytest.raises(StopIteration):
        ddp.prepare(model, None, DataParallelConfig(sync_bn=True), "cuda", group=subgroup)
    assert seen == [subgroup]


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
