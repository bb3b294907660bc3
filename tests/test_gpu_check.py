"""scripts/gpu-check.sh on a machine without a usable GPU: one line, exit 2, nothing run."""

import subprocess
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
