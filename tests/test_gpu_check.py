"""scripts/gpu-check.sh on a machine without a usable GPU: one line, exit 2, nothing run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the script would run its GPU stages (minutes)")
def test_gpu_check_says_in_one_line_that_it_needs_a_gpu(tmp_path):
    # cwd elsewhere: the script finds the checkout from its own path
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1 and lines[0].startswith("gpu-check: needs") and "nothing was run" in lines[0], lines


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp2_stage_check_passes_on_gloo_ranks():
    # the fsdp2 stage's script, on CPU ranks: launches itself, trains, saves and reloads sharded
    script = SCRIPT.parent / "gpu-check-fsdp.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, str(script), "--backend", "gloo", "--nproc", "2"], capture_output=True,
                          text=True, timeout=240, env=env)
    result = [ln for ln in done.stdout.splitlines() if ln.startswith("gpu-check-fsdp: RESULT")]
    assert done.returncode == 0 and result, (done.stdout + done.stderr)[-3000:]
    assert result[-1].startswith("gpu-check-fsdp: RESULT PASS fsdp2 world 2 on CPU"), result
    assert "0.50x unsharded" in result[-1] and "reloaded exactly" in result[-1]
