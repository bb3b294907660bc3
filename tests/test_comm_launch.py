"""`turbotrain launch` and `turbotrain comm-bench` end to end: gloo ranks under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from turbotrain.bench.comm_bench import bus_factor

pytestmark = pytest.mark.dist

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from turbotrain import comm
    info = comm.init(backend="gloo", timeout_s=30)
    t = torch.tensor([float(info.rank + 1)])
    torch.distributed.all_reduce(t)
    row = dict(rank=info.rank, world=info.world_size, local=info.local_rank, backend=info.backend,
               launcher=info.launcher, total=t.item(), algo=os.environ.get("NCCL_ALGO"),
               socks=os.environ.get("NCCL_NSOCKS_PERTHREAD"), arg=sys.argv[2])
    with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
        json.dump(row, f)
    torch.distributed.destroy_process_group()
""")


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "OMPI_", "PMI_", "SLURM_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_launch_starts_torchrun_ranks_with_the_preset(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "turbotrain.cli", "launch", "--nproc", "2", "--nccl-preset", "ethernet",
           str(script), str(tmp_path), "hello"]
    proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NCCL_SOCKET_NTHREADS=4  (preset ethernet)" in proc.stdout
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, row in enumerate(rows):
        assert row == dict(rank=r, world=2, local=r, backend="gloo", launcher="torchrun", total=3.0,
                           algo="Ring", socks="4", arg="hello")


# Inside the job: where is the rendezvous, and which sockets of this rank and of torchrun's agent (its
# parent) are listening? /proc/net/tcp{,6} lists every socket by inode; /proc/PID/fd names the
# inodes a process holds. Address 0.0.0.0 / :: means every interface.
LISTENERS = textwrap.dedent("""
    import json, os, sys

    def inodes(pid):
        out = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(target[8:-1])
        return out

    def listening(pids):
        mine = set().union(*(inodes(p) for p in pids))
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.read().splitlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in mine:  # state 0A = LISTEN
                        found.append(cols[1].split(":")[0])
        return found

    row = dict(addr=os.environ.get("MASTER_ADDR"), port=os.environ.get("MASTER_PORT"),
               listening=listening([os.getpid(), os.getppid()]))
    with open(sys.argv[1], "w") as f:
        json.dump(row, f)
""")
ANY_ADDRESS = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0 and :: in /proc's hex
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def test_launch_binds_the_rendezvous_to_loopback(tmp_path):
    script = tmp_path / "listeners.py"
    script.write_text(LISTENERS)
    out = tmp_path / "row.json"
    cmd = [sys.executable, "-m", "turbotrain.cli", "launch", "--nproc", "1", str(script), str(out)]
    proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--standalone" not in proc.stdout
    row = json.loads(out.read_text())
    assert row["addr"] == "127.0.0.1"
    assert row["listening"], "torchrun's agent should hold the rendezvous store's listening socket"
    assert not set(row["listening"]) & ANY_ADDRESS, row  # the store is on loopback, not on every interface
    assert set(row["listening"]) <= LOOPBACK, row


def test_launch_refuses_invalid_nccl_override(tmp_path):
    cmd = [sys.executable, "-m", "turbotrain.cli", "launch", "--nproc", "2", "--nccl-env", "NCCL_BUFFSIZE=big",
           "--dry-run", "job.py"]
    proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "NCCL_BUFFSIZE='big' must be an integer" in proc.stderr


def test_comm_bench_two_gloo_ranks_writes_nccl_tests_rows(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "turbotrain.cli", "comm-bench", "--nproc", "2", "--backend", "gloo",
           "--min-bytes", "1K", "--max-bytes", "16K", "--iters", "3", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "busbw" in proc.stdout and "#wrong" in proc.stdout
    rows = json.loads(out.read_text())
    ops = {r["config"]["op"] for r in rows}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    assert {r["config"]["size"] for r in rows} == {1024, 4096, 16384}
    for r in rows:
        assert r["wrong"] == 0 and r["time_us"] > 0
        assert r["busbw"] == pytest.approx(r["algbw"] * bus_factor(r["config"]["op"], 2))
        assert r["algbw"] == pytest.approx(r["config"]["size"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["p20"] <= r["median"] <= r["p80"]
        assert {"workload", "metric", "unit", "device", "versions", "timestamp"} <= set(r)
