"""`turbotrain launch` and `turbotrain comm-bench` end to end: two gloo ranks under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from turbotrain.comm.bench import bus_factor

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
