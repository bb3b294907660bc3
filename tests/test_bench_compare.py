"""turbotrain.bench.compare: the benchmark ladder on a user's own model, from the user's own script."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from turbotrain.bench.runner import LadderSettings
from turbotrain.errors import ConfigError

# A user's script: the model, the loss and the batches defined at its top level, the work under
# __main__ (every row's worker runs the script again, as __mp_main__, to find the functions).
SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from torch import nn

    import turbotrain.bench


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.fc, self.act, self.head = nn.Embedding(32, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32)

        def forward(self, ids):
            return self.head(self.act(self.fc(self.embed(ids))))


    def build():
        torch.manual_seed(0)
        return Net()


    def loss_fn(logits, targets):
        return nn.functional.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))


    if __name__ == "__main__":
        g = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(6):
            ids = torch.randint(0, 32, (4, 8), generator=g)
            batches.append((ids, (3 * ids + 1) % 32))
        turbotrain.bench.compare(build, batches, loss_fn=loss_fn, configs="fp32-eager,tt-fused-fp32", unit="tokens",
                                 steps=2, rounds=2, warmup=1, device="cpu", out=sys.argv[1])
''')


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    (tmp / "my_training.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(tmp / "my_training.py"), str(tmp / "out")], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp)
    return proc, tmp / "out"


def test_compare_runs_the_ladder_on_a_model_defined_in_the_users_script(compared):
    proc, out = compared
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    configs = results["configs"]
    assert list(configs) == ["fp32-eager", "fp32-eager#2", "tt-fused-fp32"]  # the reference's A/A row included
    assert all(c["status"] == "ok" for c in configs.values()), {k: c.get("error") for k, c in configs.items()}
    header = results["header"]
    assert header["workload"]["name"] == "user" and header["workload"]["items_per_step"] == 4 * 8  # tokens
    assert header["workload"]["unit"] == "tokens"
    assert header["workload"]["description"] == "build on 5 train / 1 val batches of 4 rows"
    assert header["flops_per_step"] > 0 and header["run"]["optimizer"]["fused"] is True
    # every row trained the same model on the same batches: the val losses agree in fp32
    vals = [c["val_loss"] for c in configs.values()]
    assert max(vals) - min(vals) <= 1e-4 * abs(vals[0]), vals
    assert (out / "report.html").stat().st_size > 0


@pytest.mark.parametrize("batch, unit, items", [
    ((torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)), "samples", 4),
    ((torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)), "tokens", 32),
    ({"attention_mask": torch.ones(2, 5), "input_ids": torch.zeros(2, 5, dtype=torch.long)}, "tokens", 10),
])
def test_throughput_counts_rows_or_tokens_of_the_inputs(batch, unit, items):
    from turbotrain.bench.configs import make_optimizer
    from turbotrain.workloads.user import user_workload

    workload = user_workload(nn.Identity, make_optimizer, [batch, batch], unit=unit)
    assert (workload.unit, workload.items_per_batch) == (unit, items)


def test_an_unknown_unit_is_refused():
    from turbotrain.bench.configs import make_optimizer
    from turbotrain.workloads.user import user_workload

    with pytest.raises(ConfigError, match="samples' or 'tokens"):
        user_workload(nn.Identity, make_optimizer, [torch.zeros(2, 3)] * 2, unit="words")


def test_a_user_workload_takes_no_overrides():
    with pytest.raises(ConfigError, match="model_fn"):
        LadderSettings(workload="user", payload="workload.pkl", overrides={"d": 64})


def test_functions_that_cannot_reach_the_row_processes_are_refused_before_any_work(tmp_path):
    import turbotrain.bench

    batches = [(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))] * 2
    with pytest.raises(ConfigError, match="importable"):
        turbotrain.bench.compare(lambda: nn.Linear(3, 2), batches, loss_fn=nn.functional.cross_entropy,
                                 out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


class OwnLossNet(nn.Module):
    """nanoGPT's contract: forward(idx, targets) returns (logits, loss)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, ids, targets=None):
        logits = self.head(self.embed(ids))
        if targets is None:
            return logits, None
        return logits, nn.functional.cross_entropy(logits.view(-1, 32), targets.view(-1), ignore_index=-1)


def _own_loss_batches():
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 32, (4, 8), generator=g) for _ in range(3)]
    return [(i, (5 * i + 3) % 32) for i in ids]


def test_every_row_trains_a_model_that_computes_its_own_loss_from_the_targets():
    """compare(build, batches) with no loss_fn on a nanoGPT-shaped model: the peers' loop and the
    Engine both call model(inputs, targets) and take its loss (the peers used to call loss_fn=None)."""
    from turbotrain import Config, Engine
    from turbotrain.bench.configs import make_optimizer
    from turbotrain.bench.peers import PeerTrainer
    from turbotrain.workloads.user import user_workload

    def build():
        torch.manual_seed(0)
        return OwnLossNet()

    batches = _own_loss_batches()
    work = user_workload(build, make_optimizer, batches)
    trainer = PeerTrainer(work, "cpu")
    peer = [float(trainer.step(b)) for b in batches[:2]]
    engine = Engine(build(), make_optimizer, config=Config(device="cpu", precision="fp32"))
    tt = [float(engine.step(b).loss) for b in batches[:2]]
    assert peer == pytest.approx(tt, rel=1e-6)
    assert work.loss(build(), batches[0]).item() == pytest.approx(peer[0], rel=1e-6)
