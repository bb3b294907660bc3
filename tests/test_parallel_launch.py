"""A new user's script, launched as a user launches it: `turbotrain launch --nproc 2 examples/parallel_train.py`.

Each run is two fresh gloo processes (about 13 s each on the shared 2-core machine, mostly start-up),
so only FSDP on the turbotrain gpt runs in the default tier; the other three are slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "parallel_train.py"
TURBOTRAIN = Path(sys.executable).parent / "turbotrain"  # the console script of the interpreter running the tests
SUMMARY = re.compile(r"^parallel_train: mode=(\S+) model=(\S+) world=(\d+) loss ([\d.]+) -> ([\d.]+) over (\d+) steps$",
                     re.M)


@pytest.mark.parametrize("mode, model", [
    ("fsdp", "gpt"),
    pytest.param("tp-sp", "gpt", marks=pytest.mark.slow),
    pytest.param("fsdp", "hf-llama", marks=pytest.mark.slow),
    pytest.param("tp-sp", "hf-llama", marks=pytest.mark.slow),
])
def test_user_script_trains_under_turbotrain_launch(mode, model, tmp_path):
    if model == "hf-llama":
        pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    done = subprocess.run([str(TURBOTRAIN), "launch", "--nproc", "2", str(SCRIPT), "--mode", mode, "--model", model],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    found = SUMMARY.search(done.stdout)
    assert found, output[-4000:]
    got_mode, got_model, world, first, last, steps = found.groups()
    assert (got_mode, got_model, int(world), int(steps)) == (mode, model, 2, 30)
    # 30 AdamW steps at lr 3e-3: the gpt drops ~0.9 nats from ln(512) = 6.2, the llama ~1.9 from ln(256)
    assert float(last) < 0.95 * float(first), found.group(0)
