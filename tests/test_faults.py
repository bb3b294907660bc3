"""Faults a user meets, tried the way a user meets them, through the Engine (issue #12).

* A rank of a two-rank data-parallel run dies (``kill -9``) or stalls (``SIGSTOP``) mid-training:
  the other rank fails within a bounded time, naming the lost peer or the timeout, and a restart
  from the last checkpoint continues the uninterrupted run's losses bitwise. The ranks are real
  processes started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, so the kill is real; this file
  is also their script (``python tests/test_faults.py '<spec as JSON>'``).
* A save onto a full file system is a CheckpointError; the previous checkpoint still resumes.
* Bad settings, batches, losses, paths and files each give an error that names the problem and
  the fix, and leave the Engine able to train the next good batch.

What each test checks is listed in docs/reliability.md.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from test_checkpoint_integrity import fake_torch_save_like_torch_reports_it, tiny_filesystem  # noqa: F401
from turbotrain import CheckpointError, Config, ConfigError, Engine, TurbotrainError
from turbotrain.checkpoint import load_checkpoint

F = nn.functional

GPT = dict(d=32, n_layer=2, n_head=4, T=16, B=4, vocab_size=512)
LR = 1e-2


def _workload(**overrides):
    from turbotrain.workloads import get_workload

    return get_workload("gpt", **{**GPT, **overrides})


def _gpt_engine(wl, *, loss_fn=None, config: Config | None = None, path=None) -> Engine:
    """The run every data-parallel test trains: AdamW with a step LR schedule, so both have state to resume."""
    model = wl.build_model()
    args = dict(optimizer=torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01),
                loss_fn=loss_fn or wl.loss_fn, config=config or Config(device="cpu"),
                scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5))
    return Engine(model, **args) if path is None else Engine.load(path, model, **args)


# -- the ranks' script ---------------------------------------------------------------------------
def _rank_main(spec: dict) -> None:
    """One rank: train ``steps`` steps data-parallel, rank 0 saving every ``save_every`` to ``ckpt``.

    ``fault`` ('kill' or 'stop') is what rank ``victim`` does to itself during step ``fault_step``,
    after its forward pass: the other rank is then waiting in the gradient exchange. With
    ``reference``, each rank trains the whole run and then a fresh Engine resumed from ``resume``;
    every loss goes to rank{r}.jsonl as float.hex(), so the test compares bits.
    """
    torch.set_num_threads(1)
    from turbotrain import comm

    rank = int(os.environ["RANK"])
    # The Engine starts the process group with init()'s default timeout; starting it first is how
    # a user sets another one (init() is then a no-op for the Engine).
    comm.init(backend="gloo", timeout_s=spec["timeout_s"])
    wl = _workload()
    config = Config(device="cpu", data_parallel=True)
    log = open(Path(spec["out"]) / f"rank{rank}.jsonl", "a", buffering=1)

    def train(run: str, engine: Engine, save: bool) -> None:
        batches = wl.batches("train", seed=rank)
        for _ in range(engine.steps):  # where the resumed run's data continues
            next(batches)
        while engine.steps < spec["steps"]:
            loss = engine.step(next(batches)).loss
            log.write(json.dumps({"run": run, "step": engine.steps, "loss": float(loss).hex()}) + "\n")
            if save and rank == 0 and engine.steps % spec["save_every"] == 0:
                engine.save(spec["ckpt"])

    if spec.get("reference"):
        train("reference", _gpt_engine(wl, config=config), save=False)
        train("resumed", _gpt_engine(wl, config=config, path=spec["resume"]), save=False)
        return
    holder = {}

    def loss_fn(output, targets):
        if rank == spec["victim"] and holder["engine"].steps + 1 == spec["fault_step"]:
            os.kill(os.getpid(), signal.SIGKILL if spec["fault"] == "kill" else signal.SIGSTOP)
        return wl.loss_fn(output, targets)

    holder["engine"] = _gpt_engine(wl, loss_fn=loss_fn, config=config)
    train("faulty", holder["engine"], save=True)


# -- launching ranks -----------------------------------------------------------------------------
STEPS, SAVE_EVERY, FAULT_STEP = 12, 3, 8  # the last checkpoint before the fault holds step 6
LAST_SAVED = (FAULT_STEP - 1) // SAVE_EVERY * SAVE_EVERY
SURVIVOR_BOUND_S = 60
# gloo's two wordings: the peer's socket reset during a read, or closed between two
PEER_LOST = re.compile(r"\[127\.0\.0\.1\]:\d+: Connection reset by peer|Connection closed by peer \[127\.0\.0\.1\]:\d+")


def _launch(out: Path, spec: dict, world: int = 2) -> list[subprocess.Popen]:
    from test_comm_dist import _free_port
    from test_comm_launch import _clean_env

    spec = {**spec, "out": str(out)}
    port, procs = _free_port(), []
    for rank in range(world):
        env = {**_clean_env(), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with open(out / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(spec)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=Path(__file__).parent))
    return procs


def _wait(proc: subprocess.Popen, seconds: float) -> int | None:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _stopped(proc: subprocess.Popen) -> bool:
    try:
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()  # SIGKILL also ends a stopped process
            p.wait()


def _losses(out: Path, rank: int, run: str) -> dict[int, str]:
    rows = [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["run"] == run}


def _fault_run(out: Path, fault: str, victim: int, timeout_s: float, started_bound_s: float = 120) -> dict:
    """Launch the faulty run; returns the survivor's exit code, its log, and seconds from fault to exit."""
    spec = dict(steps=STEPS, save_every=SAVE_EVERY, ckpt=str(out / "last.pt"), victim=victim, fault=fault,
                fault_step=FAULT_STEP, timeout_s=timeout_s)
    procs = _launch(out, spec)
    victim_proc, survivor = procs[victim], procs[1 - victim]
    try:
        deadline = time.monotonic() + started_bound_s
        while not (victim_proc.poll() is not None or _stopped(victim_proc)):
            assert time.monotonic() < deadline, "the victim rank never reached its fault step"
            time.sleep(0.05)
        faulted = time.monotonic()
        code = _wait(survivor, SURVIVOR_BOUND_S)
        return {"victim_code": victim_proc.poll(), "code": code, "after_s": time.monotonic() - faulted,
                "log": (out / f"rank{1 - victim}.log").read_text(), "survivor": 1 - victim}
    finally:
        _end(procs)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """Rank 1 killed with SIGKILL during step 8; rank 0 saved last.pt at steps 3 and 6."""
    out = tmp_path_factory.mktemp("killed")
    return out, _fault_run(out, "kill", victim=1, timeout_s=30)


def _assert_survivor_failed(run: dict, message: re.Pattern) -> None:
    assert run["code"] is not None, f"the surviving rank still ran {SURVIVOR_BOUND_S} s after the fault (a hang)"
    assert run["code"] != 0, run["log"][-3000:]
    assert message.search(run["log"]), run["log"][-3000:]
    assert "engine.step(" in run["log"]  # raised from the step, where the user's loop can catch it
    assert "DistributedError: rank" in run["log"] and "Engine.load" in run["log"]  # says what to do


# -- a rank lost or stalled mid-training --------------------------------------------------------
@pytest.mark.dist
def test_kill_9_of_a_rank_ends_the_survivor_promptly_naming_the_lost_peer(killed_run):
    out, run = killed_run
    assert run["victim_code"] == -signal.SIGKILL
    _assert_survivor_failed(run, PEER_LOST)
    # a closed connection is seen at once; the 30 s process-group timeout is the bound if it is not
    assert run["after_s"] < 30
    survivor_steps = sorted(_losses(out, run["survivor"], "faulty"))
    assert survivor_steps[-1] == FAULT_STEP - 1  # it stopped in the step where its peer died


@pytest.mark.dist
def test_kill_9_of_rank_0_the_store_host_ends_rank_1_too(tmp_path):
    run = _fault_run(tmp_path, "kill", victim=0, timeout_s=30)
    assert run["victim_code"] == -signal.SIGKILL
    _assert_survivor_failed(run, PEER_LOST)
    assert run["after_s"] < 30


@pytest.mark.dist
def test_resume_from_the_last_checkpoint_of_a_killed_run_matches_the_uninterrupted_run_bitwise(killed_run, tmp_path):
    killed, _ = killed_run
    procs = _launch(tmp_path, dict(steps=STEPS, timeout_s=60, reference=True, resume=str(killed / "last.pt")))
    try:
        codes = [_wait(p, 240) for p in procs]
    finally:
        _end(procs)
    assert codes == [0, 0], [(tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2)]
    for rank in range(2):
        reference = _losses(tmp_path, rank, "reference")
        resumed = _losses(tmp_path, rank, "resumed")
        assert sorted(reference) == list(range(1, STEPS + 1))
        assert sorted(resumed) == list(range(LAST_SAVED + 1, STEPS + 1))  # from the last save on
        assert resumed == {s: reference[s] for s in resumed}, f"rank {rank}: losses differ after the resume"
    faulty = _losses(killed, 0, "faulty")  # the killed run was this same run until the fault
    assert faulty == {s: _losses(tmp_path, 0, "reference")[s] for s in faulty}


@pytest.mark.dist
def test_a_stalled_rank_ends_the_survivor_after_the_process_group_timeout(tmp_path):
    run = _fault_run(tmp_path, "stop", victim=1, timeout_s=10)
    _assert_survivor_failed(run, re.compile(r"Timed out waiting 10000ms"))
    assert 5 < run["after_s"] < 10 + 20  # the timeout, not an instant failure and not a hang


def test_a_process_group_timeout_that_is_not_a_positive_number_is_refused():
    from turbotrain import comm

    for bad in (0, -5, "30", None):
        with pytest.raises(ConfigError, match="timeout_s=.* must be a number > 0"):
            comm.init(backend="gloo", timeout_s=bad)


EXIT_SCRIPT = """
import sys, threading, time
import torch
import torch.distributed as dist
from turbotrain import comm
comm.init(backend="gloo", timeout_s=30)
entered = threading.Event()

def callback(fut):  # a comm hook's .then(): it runs, and is released, on one of gloo's threads
    entered.set()
    time.sleep(float(sys.argv[1]))  # still there when the script's last line has run
    return fut.value()[0]

t = torch.ones(1)
chained = dist.all_reduce(t, async_op=True).get_future().then(callback)
entered.wait()
print("sum", t.item(), flush=True)
"""


@pytest.mark.dist
def test_a_rank_whose_last_collective_is_still_finishing_at_exit_exits_cleanly(tmp_path):
    # Left alone, the gloo thread that runs a completion callback asks for the GIL after the
    # interpreter began to finalize and the rank aborts after its work is done ("terminate called
    # without an active exception", exit -6): here the callback takes 20 ms, well inside the
    # 0.1 s drain init() registers at exit, and without it this run aborted in 8 of 8 tries.
    from test_comm_dist import _free_port
    from test_comm_launch import _clean_env

    script = tmp_path / "job.py"
    script.write_text(EXIT_SCRIPT)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(script), "0.02"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**_clean_env(), "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("sum 2.0" in out for out in outs), outs

# -- a full file system ------------------------------------------------------------------------
def _mlp_engine(config: Config | None = None, loss_fn=F.cross_entropy, path=None) -> Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = config or Config(device="cpu")
    return Engine(model, opt, loss_fn, config=config) if path is None else Engine.load(path, model, opt, loss_fn,
                                                                                     config=config)


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(n)]


def _train(engine: Engine, batches) -> list[str]:
    return [float(engine.step(b).loss).hex() for b in batches]


def _weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fill(directory: Path) -> Path:
    """Write a file until the file system has no space left."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


@pytest.mark.parametrize("full", ["enospc", "tmpfs"])
def test_an_engine_save_onto_a_full_disk_fails_clearly_and_the_previous_checkpoint_resumes(full, tmp_path,
                                                                                         monkeypatch, request):
    directory = request.getfixturevalue("tiny_filesystem") if full == "tmpfs" else tmp_path
    path = directory / "ck.pt"
    data = _batches(6)
    engine = _mlp_engine()
    _train(engine, data[:2])
    engine.save(path)
    straight = _train(engine, data[2:4])
    if full == "tmpfs":  # a real one: torch's own writes fail
        filler = _fill(directory)
    else:
        monkeypatch.setattr(torch, "save", fake_torch_save_like_torch_reports_it)
    with pytest.raises(CheckpointError, match=r"No space left on device \(ENOSPC\).*is unchanged.*free space"):
        engine.save(path)
    if full == "tmpfs":
        filler.unlink()
    monkeypatch.undo()
    assert sorted(p.name for p in directory.iterdir()) == ["ck.pt"]  # no temporary file left
    straight += _train(engine, data[4:])  # the Engine trains on
    resumed = _mlp_engine(path=path)
    assert resumed.steps == 2
    assert _train(resumed, data[2:]) == straight


# -- random number generators ---------------------------------------------------------------------
@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA device")]),
])
def test_a_run_with_dropout_resumes_bitwise_because_its_devices_rng_is_saved(device, tmp_path):
    """Dropout draws its masks from the device's generator, so only a restored generator repeats them."""
    def engine(path=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.GELU(), nn.Linear(64, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        config = Config(device=device)
        return Engine(model, opt, F.cross_entropy, config=config) if path is None else \
            Engine.load(path, model, opt, F.cross_entropy, config=config)

    data = _batches(6)
    straight = engine()
    _train(straight, data[:2])
    straight.save(tmp_path / "ck.pt")
    after = _train(straight, data[2:])
    assert _train(engine(tmp_path / "ck.pt"), data[2:]) == after
    moved = engine(tmp_path / "ck.pt")
    torch.manual_seed(1) if device == "cpu" else torch.cuda.manual_seed_all(1)
    assert _train(moved, data[2:]) != after  # the control: another generator state, other masks


# -- bad inputs, one by one ------------------------------------------------------------------------
def test_accumulate_0_is_refused_naming_the_bound():
    with pytest.raises(ConfigError, match=r"accumulate=0 is not valid; it must be an integer >= 1"):
        Config(accumulate=0)


def test_an_unknown_fusion_pattern_is_refused_listing_the_valid_ones():
    with pytest.raises(ConfigError, match=r"fuse pattern='nope' is not valid; choose one of: .*'qkv'"):
        Config(fuse=("nope",))


def _nan_batch(batch):
    x = batch[0].clone()
    x[2, 3] = float("nan")
    return x, batch[1]


def test_a_nan_batch_without_nan_check_is_trained_on_and_the_loss_says_so():
    """Documented, not protected: without nan_check the step is taken as given (no host sync)."""
    data = _batches(2)
    engine = _mlp_engine()
    stats = engine.step(_nan_batch(data[0]))
    assert torch.isnan(stats.loss) and stats.optimizer_stepped and not stats.skipped
    assert not all(torch.isfinite(p).all() for p in engine.module.parameters())  # the weights took the NaN


def test_a_nan_batch_with_nan_check_is_refused_naming_the_batch_and_the_next_good_one_trains():
    data = _batches(4)
    engine = _mlp_engine(Config(device="cpu", nan_check=True))
    before = _weights(engine)
    with pytest.raises(TurbotrainError, match=r"(?s)inf/NaN.*the batch itself contains inf/NaN.*fix the data"):
        engine.step(_nan_batch(data[0]))
    assert _same(_weights(engine), before) and engine.steps == 0
    assert _train(engine, data[1:]) == _train(_mlp_engine(Config(device="cpu", nan_check=True)), data[1:])


def test_a_nan_batch_under_the_fp16_loss_scaler_is_a_skipped_step():
    data = _batches(2)
    with pytest.warns(UserWarning):  # fp16 on CPU is slow, and the sizes are not multiples of 8
        engine = _mlp_engine(Config(device="cpu", precision="fp16-master"))
        masters = [m.detach().clone() for m in engine.precision.master_params]
        stats = engine.step(_nan_batch(data[0]))
    assert stats.skipped and "inf/NaN gradients" in stats.skip_reason and engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(masters, engine.precision.master_params))
    assert not engine.step(data[1]).skipped


class Interrupt:
    """A loss_fn that raises ``error`` on its ``at``-th call (counting from 0), else cross-entropy."""

    def __init__(self, error: BaseException, at: int):
        self.error, self.at, self.calls = error, at, 0

    def __call__(self, output, targets):
        self.calls += 1
        if self.calls - 1 == self.at:
            raise self.error
        return F.cross_entropy(output, targets)


@pytest.mark.parametrize("error", [ValueError("the user's loss failed"), KeyboardInterrupt()],
                         ids=["exception", "keyboard-interrupt"])
def test_an_error_in_the_loss_fn_reaches_the_user_and_the_next_batches_train_as_if_it_never_ran(error):
    """Raised half-way through an accumulated step: that step's gradients are dropped, and the next
    two good micro-batches make the step a fresh Engine makes of them."""
    data = _batches(5)
    config = Config(device="cpu", accumulate=2)
    engine = _mlp_engine(config, loss_fn=Interrupt(error, at=1))
    engine.step(data[0])
    with pytest.raises(type(error)):  # the user's own error, not wrapped: it is theirs to handle
        engine.step(data[1])
    assert all(p.grad is None for p in engine.module.parameters()) and engine.steps == 0
    assert _train(engine, data[2:]) == _train(_mlp_engine(config), data[2:])


def test_a_save_to_a_directory_names_it_and_suggests_a_file(tmp_path):
    engine = _mlp_engine()
    engine.step(_batches(1)[0])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path))} is a directory; give a file path "
                                              rf"such as {re.escape(str(tmp_path / 'ckpt.pt'))}"):
        engine.save(tmp_path)
    assert list(tmp_path.iterdir()) == []
    engine.step(_batches(1)[0])
    engine.save(tmp_path / "ckpt.pt")
    assert _mlp_engine(path=tmp_path / "ckpt.pt").steps == 2


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    wl = _workload()
    engine = _gpt_engine(wl)
    engine.step(next(wl.batches("train", seed=0)))
    path = tmp_path_factory.mktemp("gpt") / "ck.pt"
    engine.save(path)
    return path


@pytest.mark.parametrize("other, named", [
    (dict(n_layer=3), r"missing.*blocks\.2\."),
    (dict(n_layer=1), r"unexpected.*blocks\.1\."),
    (dict(d=64), r"shapes?.*wte\.weight \(512, 32\)"),
], ids=["more-layers", "fewer-layers", "wider"])
def test_loading_a_checkpoint_of_another_architecture_names_the_keys_and_changes_nothing(gpt_checkpoint, other,
                                                                                         named):
    wl = _workload(**other)
    engine = _gpt_engine(wl)
    before = _weights(engine)
    with pytest.raises(CheckpointError, match=rf"(?s)another model.*{named}"):
        engine.load_state_dict(load_checkpoint(gpt_checkpoint))
    assert _same(_weights(engine), before)  # nothing was half-loaded
    engine.step(next(wl.batches("train", seed=0)))
    model = wl.build_model()
    with pytest.raises(CheckpointError, match=rf"(?s)another model.*{named}"):
        Engine.load(gpt_checkpoint, model, torch.optim.AdamW(model.parameters()), wl.loss_fn,
                    config=Config(device="cpu"))


def test_loading_a_truncated_checkpoint_says_it_is_not_whole_and_the_model_is_untouched(gpt_checkpoint, tmp_path):
    truncated = tmp_path / "ck.pt"
    blob = gpt_checkpoint.read_bytes()
    truncated.write_bytes(blob[: len(blob) // 2])
    wl = _workload()
    model = wl.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(truncated))} is not a readable torch checkpoint.*"
                                              r"not an intact zip archive; was it fully written"):
        Engine.load(truncated, model, torch.optim.AdamW(model.parameters()), wl.loss_fn, config=Config(device="cpu"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert _gpt_engine(wl, path=gpt_checkpoint).steps == 1  # the whole file beside it still loads


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
