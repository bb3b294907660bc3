"""The interleaved ladder: every row in its own long-lived worker, measured in alternating rounds.

Running rows one after another puts each in its own stretch of time, and on a shared machine the
load in that stretch is part of its figure: a row that happened to run while a neighbour compiled
looks slow. Here the parent starts one worker per row, builds and warms them up one at a time
(untimed), then runs rounds: in each it asks every row in turn for a few timed steps (``run k``),
waiting for one to finish before the next starts, so rows never overlap. The order rotates each
round (round r starts at row r mod n), so no row always follows the same neighbour or always runs
first. Drift (thermal, frequency, a job starting elsewhere) then lands on every row alike, and the
per-round times pair up: round i of every row was measured within one short window.

>>> round_order(["a", "b", "c"], 1)
['b', 'c', 'a']
>>> split_steps(7, 3)
[3, 2, 2]
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from ..errors import check_positive
from ..hardware import check_idle_threads_sleep
from .worker import WorkerSpec

__all__ = ["round_order", "split_steps", "WorkerProcess", "run_interleaved"]


def round_order(rows: list[str], round_index: int) -> list[str]:
    """The order rows run in round ``round_index``: the ladder order rotated by the round number."""
    if not rows:
        return []
    k = round_index % len(rows)
    return rows[k:] + rows[:k]


def split_steps(steps: int, rounds: int) -> list[int]:
    """Measured steps per round: ``steps`` spread over ``rounds`` as evenly as possible (every row
    runs the same counts in the same rounds)."""
    check_positive("steps", steps)
    check_positive("rounds", rounds)
    rounds = min(rounds, steps)
    return [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]


class WorkerProcess:
    """``python -m turbotrain.bench.worker`` for one row, spoken to in JSON lines (see worker.py)."""

    def __init__(self, row: str, spec: WorkerSpec, workdir: Path):
        self.row = row
        stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in row)
        spec_path = workdir / f"{stem}.spec.json"
        self.stderr_path = workdir / f"{stem}.stderr"
        spec_path.write_text(json.dumps(asdict(spec)))
        cmd = [sys.executable, "-m", "turbotrain.bench.worker", str(spec_path)]
        with open(self.stderr_path, "w") as stderr:
            # own session, so a kill also ends the worker's children (torch.compile's compile pool)
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                         bufsize=1, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self._lines.put(json.loads(line))
            except ValueError:  # not ours: a worker only writes JSON to this pipe
                continue
        self._lines.put(None)  # end of file: the worker exited

    def _failure(self, reason: str) -> dict:
        self.kill()
        tail = self.stderr_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"ok": False, "status": "error", "error": f"worker {reason}: {tail[0]}"}

    def _next(self, timeout: float, phase: str) -> dict:
        try:
            message = self._lines.get(timeout=timeout)
        except queue.Empty:
            return self._failure(f"timed out after {timeout:.0f} s in {phase} (raise --timeout)")
        if message is None:
            return self._failure(f"died in {phase} (exit code {self.proc.wait()})")
        return message

    def wait_ready(self, timeout: float) -> dict:
        """``{"ok": True}`` once the worker has started (imports done), else an error reply."""
        message = self._next(timeout, "start")
        if message.get("event") == "ready":
            return {"ok": True}
        return message if "ok" in message else self._failure(f"sent {message!r} instead of ready")

    def receive(self, timeout: float, phase: str, on_event=None) -> dict:
        """The next reply (events go to ``on_event``); an error reply if the worker dies or is too slow."""
        while True:
            message = self._next(timeout, phase)
            if "event" in message:
                if on_event:
                    on_event(message)
                continue
            if not message.get("ok"):
                self.kill()
            return message

    def request(self, command: dict, timeout: float, on_event=None) -> dict:
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the worker is gone; receive() reports how
        return self.receive(timeout, command["cmd"], on_event)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Ask the worker to quit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def _failed(reply: dict, partial: dict | None = None) -> dict:
    out = {k: v for k, v in (partial or {}).items() if k not in ("status",)}
    return {**out, "status": "error", "error": reply.get("error", "unknown error"),
            **({"traceback": reply["traceback"]} if reply.get("traceback") else {})}


def run_interleaved(specs: dict[str, WorkerSpec], steps_per_round: list[int], workdir: Path, timeout: float,
                    live=None, on_update=None, admit=None, deadline: float | None = None,
                    setup_timeout=None, more=None, max_extra_rounds: int = 0) -> dict[str, dict]:
    """Run every row's worker through setup, the rounds and finish; one result dict per row.

    ``live`` (optional) gets ``phase(row, text)``, ``event(row, message)`` and ``update(results)``;
    ``on_update(results)`` runs after every setup and every round (the ladder rewrites its JSON
    there, so a crash or a kill keeps what was measured).

    A time budget (turbotrain tune): ``admit(row, results)`` is asked before each row is started;
    a reason string leaves the row out (``{"status": "skipped", "reason": ...}``), None admits it.
    With ``admit`` each worker starts only once admitted (else all start at once, so their imports
    overlap). No round starts after ``deadline`` (a time.monotonic() value, or a function returning
    one, asked before each round). ``setup_timeout(row)``
    bounds that row's start, build and warm-up together (else ``timeout`` bounds each).

    Extra rounds (turbotrain tune): after the planned rounds every row takes its val loss (the
    worker's ``val``), then, while ``deadline`` allows, up to ``max_extra_rounds`` more rounds of the
    last round's steps run for the rows ``more(results)`` names (the candidates not yet told apart);
    an empty list ends them. They add timings, never change a val loss.
    """
    check_idle_threads_sleep()  # the waiting workers' threads must not spin on the timed row's cores
    rows = list(specs)
    results: dict[str, dict] = {}
    workers: dict[str, WorkerProcess] = {}
    if admit is None:  # imports overlap; nothing is timed yet
        workers = {row: WorkerProcess(row, specs[row], workdir) for row in rows}

    def notify():
        if live:
            live.update(results)
        if on_update:
            on_update(results)

    try:
        for row in rows:
            if admit is not None:
                reason = admit(row, results)
                if reason is not None:
                    results[row] = {"status": "skipped", "reason": reason}
                    notify()
                    continue
                workers[row] = WorkerProcess(row, specs[row], workdir)
            if live:
                live.phase(row, "starting worker")
            started = time.monotonic()
            limit = setup_timeout(row) if setup_timeout is not None else None
            ready = workers[row].wait_ready(timeout if limit is None else limit)
            if not ready["ok"]:
                results[row] = _failed(ready)
                notify()
                continue
            if live:
                live.phase(row, "build and warm-up")
            left = timeout if limit is None else max(1.0, limit - (time.monotonic() - started))
            reply = workers[row].request({"cmd": "setup"}, left,
                                         on_event=(lambda m, row=row: live.event(row, m)) if live else None)
            if reply.get("ok"):
                results[row] = {"status": "running", "config": specs[row].config, "compute_dtype": reply["compute_dtype"],
                                "build_seconds": reply["build_seconds"], "warmup_seconds": reply["warmup_seconds"],
                                "warmup_step_seconds": reply.get("warmup_step_seconds", []),
                                "setup_wall_seconds": time.monotonic() - started,
                                "losses": reply["losses"], "round_seconds": []}
            else:
                results[row] = _failed(reply)
            notify()
        def past_deadline() -> bool:
            return deadline is not None and time.monotonic() > (deadline() if callable(deadline) else deadline)

        def one_round(r: int, steps: int, names: list[str], label: str) -> None:
            for row in round_order(names, r):
                if live:
                    live.phase(row, label)
                reply = workers[row].request({"cmd": "run", "steps": steps}, timeout)
                if reply.get("ok"):
                    results[row]["round_seconds"].append(reply["seconds"])
                    results[row]["losses"] += reply["losses"]
                else:
                    results[row] = _failed(reply, results[row])
            notify()

        for r, steps in enumerate(steps_per_round):
            if past_deadline():
                break
            one_round(r, steps, [n for n in rows if results[n]["status"] == "running"],
                      f"round {r + 1}/{len(steps_per_round)}")
        else:
            extra_rounds = max_extra_rounds if more is not None and deadline is not None else 0
            if extra_rounds:
                # Every row's val loss after the same steps, before the extra rounds train some rows further.
                for row in [n for n in rows if results[n]["status"] == "running"]:
                    if live:
                        live.phase(row, "val loss")
                    reply = workers[row].request({"cmd": "val"}, timeout)
                    if reply.get("ok"):
                        results[row]["val_loss"] = reply["val_loss"]
                    else:
                        results[row] = _failed(reply, results[row])
                notify()
            for extra in range(extra_rounds):
                names = [n for n in more(results) if results.get(n, {}).get("status") == "running"]
                if not names or past_deadline():
                    break
                one_round(len(steps_per_round) + extra, steps_per_round[-1], names, f"extra round {extra + 1}")
        for row in rows:
            if results[row]["status"] != "running":
                continue
            if live:
                live.phase(row, "val loss")
            reply = workers[row].request({"cmd": "finish"}, timeout)
            if reply.get("ok"):
                reply.pop("ok")
                rounds = results[row]["round_seconds"]
                results[row].update(reply, status="ok", rounds=len(rounds),
                                    step_seconds=[s for steps in rounds for s in steps])
            else:
                results[row] = _failed(reply, results[row])
        notify()
    finally:
        for worker in workers.values():
            worker.close()
    return results
