"""One benchmark row in its own long-lived process: ``python -m turbotrain.bench.worker SPEC.json``.

A process per row means no row inherits another's compiled graphs, patched modules, allocator
state or thread pools. The process stays alive for the whole ladder, so the parent can interleave
the rows: it builds every row first, then asks each in turn, round after round, for a few timed
steps, and drift on the machine lands on every row alike (bench/interleave.py).

The protocol is JSON lines: commands on the worker's stdin, replies on its stdout. Anything else
the row prints (torch.compile, a library, a C extension) is sent to stderr, which the parent keeps
in a file, so it can never be taken for a reply.

    parent -> worker                        worker -> parent
                                            {"event": "ready"}
    {"cmd": "setup"}                        {"event": "progress", "done": i, "total": n} ...
                                            {"ok": true, "compute_dtype": ..., "build_seconds": ...,
                                             "warmup_step_seconds": [...], "losses": [...]}
    {"cmd": "run", "steps": k}              {"ok": true, "seconds": [...], "losses": [...]}
    {"cmd": "val"}                          {"ok": true, "val_loss": ...}   (optional, before finish)
    {"cmd": "finish"}                       {"ok": true, "val_loss": ..., "peak_memory_bytes": ..., ...}
    {"cmd": "quit"}                         (exits)

``val`` takes the val loss where the run stands and ``finish`` reports that one instead of taking it
again: turbotrain tune asks for it after the planned rounds, before the extra rounds only some rows
get, so every row's loss is checked after the same number of steps.

A command that fails replies ``{"ok": false, "error": ..., "traceback": ...}`` and the worker
exits: a row that failed once is not measured again.

Every row gets the same spec but its config: the same seed (hence the same initial weights), the
same train batches in the same order (warm-up first, then the measured steps round by round) and
the same val batches. Each measured step is timed on its own and ends with a device sync; batches
are drawn before the clock starts.

Memory, honestly: on CUDA the row reports torch.cuda.max_memory_allocated() during build, warm-up
and the measured steps (tensors only; the caching allocator's reserve is excluded). On CPU there is
no allocator counter, so the row reports the peak of this process's anonymous resident memory
(the kernel's high-water mark less file-backed pages, RssSampler) above its value just before the
model was built: weights, gradients, optimizer state, activations, whatever the
allocator keeps cached, torch's one-time lazy initialisation on the first step, and for compiled
rows the compiler's own memory. File-backed pages are left out because touching libtorch's code
pages would otherwise count as training memory.

Because that figure includes what glibc keeps after a free and what the compiler holds (a compiled
HF Llama row kept ~1.3 GB of resident memory after its first step with the same 310 MB of live
tensors as the peer), CPU rows also report ``tensor_peak_bytes``, what CUDA's figure measures:
the tensors alive between steps plus the most one more step (after the val loss) allocates above
them, from torch.profiler's allocation events (memory.measure.step_tensor_peak).

Where the time goes, per row: ``finish`` also profiles a couple of steps on CPU and splits them into
GEMMs, attention kernels, the optimizer and the rest (``step_split``, bench/split.py), and reports
the minor page faults a measured step took (``page_faults_per_step``): the report sets the GEMMs'
time in the step against their floor, the same GEMMs timed alone (bench/ceiling.py).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..hardware import page_faults
from ..memory.measure import live_tensor_bytes, step_tensor_peak
from ..profile.counting import OpCounter
from ..utils import atomic_write, sync_device
from .split import profile_split

__all__ = ["WorkerSpec", "RowSession", "serve", "load_workload", "fixed_batches", "RssSampler", "CPU_MEMORY_METHOD",
           "CPU_TENSOR_METHOD", "CUDA_MEMORY_METHOD", "error_result", "write_result", "load_payload"]

CPU_MEMORY_METHOD = ("peak anonymous RSS of the worker above its value before the model was built (the kernel's "
                     "high-water mark, reset at each command; 5 ms sampling where the kernel cannot reset it)")
CPU_TENSOR_METHOD = ("tensors alive between steps above those before the model was built (gc scan) plus the most one "
                     "more step allocates above them (torch.profiler memory events): the CPU's max_memory_allocated")
CUDA_MEMORY_METHOD = "torch.cuda.max_memory_allocated() during build, warm-up and measured steps"
SPLIT_STEPS = 2
"""Steps profiled at finish for bench/split.py's split (after every measured step and the val loss)."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one row needs; identical across rows except ``config``."""

    workload: str
    config: str
    device: str
    warmup: int
    """Steps run first and not timed (compilation happens here)."""
    seed: int = 0
    val_batches: int = 4
    overrides: dict = field(default_factory=dict)
    """Workload settings changed from its defaults (quick mode shrinks the model)."""
    threads: int | None = None
    """torch intra-op threads; the parent passes its own so peaks and rows use the same count."""
    engine_config: dict | None = None
    """A Config.to_dict() the row is built from (config 'tt-config': turbotrain tune's candidates)."""
    payload: str | None = None
    """A file turbotrain.tune wrote (load_payload) holding a user's workload, used instead of ``workload``."""
    count_ops: bool = True
    """Count the ATen ops of one more step at finish (the fusion ablation); tune turns it off."""
    profile_steps: bool = True
    """Profile a few more steps at finish on CPU: the tensor peak and bench/split.py's split. Tune turns
    it off: its table reads neither, and each profiled step costs several plain ones of its budget."""


def load_workload(name: str, overrides: dict | None = None):
    """turbotrain.workloads.get_workload(name, **overrides); UnknownWorkloadError for a bad name."""
    from ..workloads import get_workload

    return get_workload(name, **(overrides or {}))


def load_payload(path: str):
    """The workload object in a file turbotrain.tune wrote: ``{"sys_path", "main_path", "workload"}``.

    The user's functions are pickled by reference, so the paths they were imported from are put on
    sys.path before they are unpickled. Functions of the user's script (module ``__main__``) are
    found by running that script as ``__mp_main__``, as multiprocessing's spawn does: its top level
    runs again, so the script must keep its work under ``if __name__ == "__main__":``.
    """
    import io
    import pickle
    import runpy
    import types

    data = pickle.loads(Path(path).read_bytes())
    for entry in reversed(data["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "__main__" and data.get("main_path"):
                # Importing torch (multiprocessing) already aliases __mp_main__ to this process's own
                # __main__, so the user's script is recognised by its path, not by the name being taken.
                loaded = sys.modules.get("__mp_main__")
                if getattr(loaded, "__file__", None) != data["main_path"]:
                    main = types.ModuleType("__mp_main__")
                    main.__dict__.update(runpy.run_path(data["main_path"], run_name="__mp_main__"))
                    main.__file__ = data["main_path"]
                    sys.modules["__mp_main__"] = main
                module = "__mp_main__"
            return super().find_class(module, name)

    return Unpickler(io.BytesIO(data["workload"])).load()


def fixed_batches(workload, split: str, count: int, seed: int, device: str) -> list:
    """The first ``count`` batches of the workload's deterministic ``split`` stream."""
    stream = workload.batches(split=split, seed=seed, device=device)
    return [next(stream) for _ in range(count)]


def _reset_kernel_peak() -> None:
    """Set this process's resident high-water mark (VmHWM) to what is resident now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _kernel_peak_available() -> bool:
    """Whether this kernel keeps a resettable resident high-water mark (Linux >= 4.0)."""
    try:
        _reset_kernel_peak()
        return "VmHWM" in _status_kib()
    except OSError:
        return False


def _status_kib() -> dict[str, int]:
    """The kB figures of /proc/self/status (VmHWM, RssFile, RssShmem, ...), read once."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.rstrip().endswith("kB"):
                found[key] = int(value.split()[0])
    return found


class RssSampler:
    """Peak anonymous resident memory of this process while resumed (the CPU memory metric).

    Read from the kernel's own high-water mark: ``resume()`` resets it (``5`` written to
    /proc/self/clear_refs) and a read takes VmHWM less the file-backed and shared pages resident at
    that moment, so nothing runs beside the timed steps and no peak is too short to be seen. The
    5 ms sampling thread this replaced took ~3% of a step on the 2-core development CPU
    (tt-fused-compile on gpt, 0.668 s -> 0.689 s, 2026-12-06) and could miss short peaks. Where the
    kernel has no resettable mark, a daemon thread samples every ``interval`` seconds as before,
    and ``method`` and a one-time warning say so.

    ``pause()`` / ``resume()`` bound what counts: the worker pauses while it waits for its next
    command and while it takes the val loss.
    """

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.kernel_peak = _kernel_peak_available()
        self.method = "kernel high-water mark" if self.kernel_peak else f"{interval * 1e3:g} ms sampling"
        if not self.kernel_peak:
            _warn_once("this kernel has no resettable resident high-water mark (/proc/self/clear_refs); the CPU "
                       f"memory peak is sampled every {interval * 1e3:g} ms and can miss shorter peaks")
        self.baseline = self._peak = self.rss()
        self._stop = threading.Event()
        self._active = threading.Event()
        self._thread = None if self.kernel_peak else threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        """Anonymous resident bytes now (resident minus file-backed and shared pages)."""
        with open("/proc/self/statm") as f:
            _, resident, shared = f.read().split()[:3]
        return (int(resident) - int(shared)) * self._page

    def _mark(self) -> int:
        """The kernel's high-water mark since the last reset, less the pages that are not anonymous."""
        status = _status_kib()
        return (status["VmHWM"] - status.get("RssFile", 0) - status.get("RssShmem", 0)) * 1024

    @property
    def peak(self) -> int:
        if self.kernel_peak and self._active.is_set():
            return max(self._peak, self._mark())
        return self._peak

    def _run(self):
        while not self._stop.is_set():
            self._active.wait()
            if self._stop.wait(self.interval):
                break
            if self._active.is_set():
                self._peak = max(self._peak, self.rss())

    def pause(self) -> None:
        self._peak = max(self.peak, self.rss())
        self._active.clear()

    def resume(self) -> None:
        if self.kernel_peak:
            _reset_kernel_peak()
        self._active.set()

    def __enter__(self):
        self.resume()
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._peak = max(self.peak, self.rss())
        self._stop.set()
        self._active.set()  # wake a paused thread so it sees the stop
        if self._thread is not None:
            self._thread.join()


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"turbotrain bench: {message}", file=sys.stderr)


def count_step_ops(trainer, batch) -> int:
    """ATen ops dispatched by one more training step (forward, backward, optimizer), after the
    measurements; the fusion ablation compares it across rows. Compiled rows are not counted: their
    ops run inside generated kernels that a dispatch mode cannot see."""
    with OpCounter() as counter:
        trainer.step(batch)
    return counter.counts.calls


class RowSession:
    """One row's life: ``setup()`` (build + warm-up), ``run(k)`` any number of times, ``finish()``."""

    def __init__(self, spec: WorkerSpec, progress=None):
        self.spec = spec
        self.progress = progress or (lambda done, total: None)
        self.trainer = None
        self.stream = None
        self.val_loss = None
        self.losses: list[float] = []
        self.faults, self.measured = 0, 0  # minor page faults over the measured steps, and their count

    def _timed_step(self) -> tuple[float, float]:
        batch = next(self.stream)  # drawn (and moved to the device) before the clock starts
        sync_device(self.spec.device)
        t0 = time.perf_counter()
        loss = self.trainer.step(batch)
        sync_device(self.spec.device)
        elapsed = time.perf_counter() - t0
        self.losses.append(float(loss))
        return elapsed, self.losses[-1]

    def setup(self) -> dict:
        from .configs import COMPUTE_DTYPES, get_config

        spec = self.spec
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.workload = load_payload(spec.payload) if spec.payload else load_workload(spec.workload, spec.overrides)
        self.stream = self.workload.batches(split="train", seed=spec.seed, device=spec.device)
        build = get_config(spec.config).build
        if spec.engine_config is not None:
            build = functools.partial(build, engine_config=spec.engine_config)
        self.cuda = spec.device == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base_cuda = torch.cuda.memory_allocated()
        self.rss = RssSampler().__enter__()
        self.tensor_baseline = None if self.cuda else live_tensor_bytes()  # the workload's data, not the row's
        torch.manual_seed(spec.seed)  # same initial weights (and any RNG the step draws) in every row
        t0 = time.perf_counter()
        self.trainer = build(self.workload, spec.device)
        build_s = time.perf_counter() - t0
        dtype = getattr(self.trainer, "compute_dtype", None)
        if dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"config {spec.config!r} built a trainer whose compute_dtype is {dtype!r}; "
                              f"set it to one of {COMPUTE_DTYPES}")
        t0 = time.perf_counter()
        warmup_steps = []
        for i in range(spec.warmup):
            warmup_steps.append(self._timed_step()[0])
            self.progress(i + 1, spec.warmup)
        self.rss.pause()
        return {"compute_dtype": dtype, "build_seconds": build_s, "warmup_seconds": time.perf_counter() - t0,
                "warmup_step_seconds": warmup_steps, "losses": list(self.losses)}

    def run(self, steps: int) -> dict:
        self.rss.resume()
        faults = page_faults()
        try:
            seconds, losses = zip(*(self._timed_step() for _ in range(steps))) if steps else ((), ())
        finally:
            self.rss.pause()
        self.faults += page_faults() - faults
        self.measured += len(seconds)
        return {"seconds": list(seconds), "losses": list(losses)}

    def val(self) -> dict:
        """The val loss where the run stands (outside the memory sampler, as in finish)."""
        val = fixed_batches(self.workload, "val", self.spec.val_batches, self.spec.seed, self.spec.device)
        self.val_loss = self.trainer.eval_loss(val)
        return {"val_loss": self.val_loss}

    def finish(self) -> dict:
        self.rss.resume()
        self.rss.__exit__(None, None, None)
        spec = self.spec
        peak = torch.cuda.max_memory_allocated() - self.base_cuda if self.cuda else self.rss.peak - self.rss.baseline
        val_loss = self.val_loss if self.val_loss is not None else self.val()["val_loss"]
        profiled = spec.profile_steps and not self.cuda
        tensor_peak = self._tensor_peak() if profiled else None
        split = self._split() if profiled else None
        counted = spec.count_ops and not getattr(self.trainer, "compiled", False)
        op_count = count_step_ops(self.trainer, next(self.stream)) if counted else None
        return {"val_loss": val_loss, "ops_per_step": op_count, "peak_memory_bytes": peak,
                "tensor_peak_bytes": tensor_peak, "rss_baseline_bytes": self.rss.baseline,
                "rss_peak_bytes": self.rss.peak, "step_split": split,
                "page_faults_per_step": self.faults / self.measured if self.measured else None}

    def _split(self) -> dict:
        """bench/split.py's split of a few more steps (their batches drawn before the profiler starts)."""
        batches = iter([next(self.stream) for _ in range(SPLIT_STEPS)])
        return profile_split(lambda: self.trainer.step(next(batches)), SPLIT_STEPS)

    def _tensor_peak(self) -> int:
        """CPU: the tensors alive between steps (above those the workload held before the model was
        built) plus the most one more step allocates on top of them (memory.measure); after the val
        loss, so that loss is the one of the measured steps."""
        batch = next(self.stream)
        held = live_tensor_bytes() - self.tensor_baseline
        return held + step_tensor_peak(lambda: self.trainer.step(batch))


def serve(spec: WorkerSpec, commands, replies) -> int:
    """Answer the parent's commands (JSON lines from ``commands``) on ``replies`` until finish or quit."""

    def send(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    session = RowSession(spec, progress=lambda done, total: send({"event": "progress", "done": done, "total": total}))
    send({"event": "ready"})
    for line in commands:
        if not line.strip():
            continue
        message = json.loads(line)
        cmd = message.get("cmd")
        if cmd == "quit":
            return 0
        try:
            if cmd == "setup":
                reply = session.setup()
            elif cmd == "run":
                reply = session.run(int(message["steps"]))
            elif cmd == "val":
                reply = session.val()
            elif cmd == "finish":
                send({"ok": True, **session.finish()})
                return 0
            else:
                raise ConfigError(f"unknown worker command {cmd!r}; expected setup, run, val, finish or quit")
        except Exception as exc:  # the row fails, the ladder goes on: report the message, keep the trace
            send({"ok": False, **error_result(exc)})
            return 1
        send({"ok": True, **reply})
    return 0  # the parent closed stdin: nothing more to do


def error_result(exc: BaseException) -> dict:
    """The result document of a job that failed: its message and traceback, for the report."""
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}".strip(), "traceback": traceback.format_exc()}


def write_result(result: dict, spec, path: Path) -> None:
    """Write a job's result (with the spec it ran) atomically, so the parent never reads half a file."""
    result["spec"] = asdict(spec)
    atomic_write(path, json.dumps(result))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m turbotrain.bench.worker SPEC.json  (JSON-line commands on stdin)", file=sys.stderr)
        return 2
    spec = WorkerSpec(**json.loads(Path(argv[0]).read_text()))
    # the protocol keeps the real stdout; every other write to fd 1 (prints, C libraries) goes to stderr
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return serve(spec, sys.stdin, replies)


if __name__ == "__main__":
    sys.exit(main())
