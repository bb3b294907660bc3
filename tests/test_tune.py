"""turbotrain tune: the space is enumerated and pruned as documented, a candidate that changes the
loss is rejected by the FP32 shadow run, the chosen Config round-trips into an Engine, bad input
stops the command with one line, and a tiny end-to-end tune writes its four files in its budget."""

import doctest
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import turbotrain
from turbotrain import Config, Engine
from turbotrain.bench import configs as registry
from turbotrain.cli import main
from turbotrain.config import FUSION_PATTERNS
from turbotrain.errors import ConfigError
from turbotrain.hardware import HardwareInfo
from turbotrain.memory import checkpointed_blocks
from turbotrain.tune.facts import ModelFacts, analyse
from turbotrain.tune.prune import estimate_memory, hardware_reasons, order, predict_seconds, prune
from turbotrain.tune.report import build_document, pruned_axes, write_reports
from turbotrain.tune.row import (TUNED_ENV, TUNED_ROW, ConfigTrainer, forget_tuned_row, register_tuned_row,
                                 split_batch)
from turbotrain.tune.search import TuneSettings, _Admission, _record, parse_duration, parse_memory, run_tune
from turbotrain.tune.space import (ACCUMULATE_VALUES, CHECKPOINT_VALUES, FUSION_VALUES, PRECISION_VALUES,
                                   enumerate_space)
from turbotrain.workloads.user import save_payload, user_workload


# ------------------------------------------------------------------------------ a tiny user model
class TinyNet(nn.Module):
    """Embedding -> two blocks (Linear + ReLU, Linear) -> a head: one linear_act site per block, a
    block list to checkpoint, and a head for the fused linear+cross-entropy."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(x)))


def tiny_model():
    torch.manual_seed(0)
    return TinyNet()


def tiny_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def tiny_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_batches(count=6, rows=4, length=8):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 32, (rows, length), generator=g)
        out.append((ids, (3 * ids + 1) % 32))  # a rule per token, so a few steps visibly learn it
    return out


def _facts(**changes) -> ModelFacts:
    """Facts of a made-up model (no pass needed): 1 M parameters, 8 rows, 2 blocks, every pattern found."""
    values = dict(params=1_000_000, batch_rows=8, matmul_flops=1e9, other_bytes=1e8, activation_bytes=200 * 2**20,
                  block_count=2, block_saved_bytes=160 * 2**20, block_input_bytes=8 * 2**20,
                  max_block_saved_bytes=80 * 2**20, logits_bytes=2 * 2**20, sites={p: 1 for p in FUSION_PATTERNS})
    values.update(changes)
    return ModelFacts(**values)


def _cpu(*features) -> HardwareInfo:
    return HardwareInfo(device="cpu", cpu_model="test CPU", cpu_count=2, torch_threads=2, cpu_features=features)


PEAKS = {"fp32": 1e11}


# ---------------------------------------------------------------------------------------- the space
def test_the_space_is_every_combination_with_the_baseline_first():
    space = enumerate_space(batch_rows=8)
    assert len(space) == (len(PRECISION_VALUES) * len(FUSION_VALUES) * 2 * len(CHECKPOINT_VALUES)
                          * len(ACCUMULATE_VALUES))
    assert len({c.name for c in space}) == len(space)
    assert space[0].is_baseline and sum(c.is_baseline for c in space) == 1
    assert space[0].config() == Config()
    assert not any(c.data_parallel for c in space)


def _plain(checkpoint, every=1, batch_rows=8):
    """The fp32 candidate with nothing on but ``checkpoint`` on every ``every``-th block."""
    return enumerate_space(batch_rows, precisions=("fp32",), fusions=((),), compiles=("none",),
                           checkpoints=((checkpoint, every),), accumulates=(1,))[0]


def test_the_space_modules_docstring_examples_run():
    from turbotrain.tune import space

    assert doctest.testmod(space).failed == 0


def test_the_checkpoint_axis_holds_every_other_block_and_its_config():
    space = enumerate_space(batch_rows=8)
    every = {(c.checkpoint, c.checkpoint_every) for c in space}
    assert every == {(None, 1), ("blocks", 1), ("blocks", 2), ("selective", 1)}  # no selective/2 (space.py says why)
    half = next(c for c in space if c.checkpoint_every == 2 and c.precision == "fp32" and not c.fusion
                and c.compile == "none" and c.accumulate == 1)
    assert half.name == "fp32+ckpt:blocks/2" and half.settings()["checkpoint"] == "blocks/2"
    assert half.config() == Config(checkpoint="blocks", checkpoint_every=2)
    assert _plain("selective", 2).name == "fp32+ckpt:selective/2"  # searchable when asked for
    with pytest.raises(ConfigError, match="checkpoint_every"):
        enumerate_space(8, checkpoints=((None, 2),))  # every other block of no checkpointing
    with pytest.raises(ConfigError, match="pair"):
        enumerate_space(8, checkpoints=(("blocks",),))


def test_every_other_block_is_priced_strictly_between_none_and_blocks():
    facts = _facts()  # 200 MiB saved; all blocks checkpointed keep 40 outside + 8 inputs + 80 of one block
    none, half, blocks = _plain(None), _plain("blocks", 2), _plain("blocks")
    memory = {c.name: estimate_memory(c, facts)["activation_bytes"] for c in (none, half, blocks)}
    assert memory[none.name] > memory[half.name] > memory[blocks.name]
    # ceil(2 / 2) = 1 of 2 blocks: half the 72 MiB that checkpointing every block saves
    assert memory[half.name] == (200 - 72 // 2) * 2**20
    # ceil(3 / 2) = 2 of 3 blocks (blocks 0 and 2): two thirds of it, not the one third 3 // 2 would give
    three = estimate_memory(half, _facts(block_count=3))["activation_bytes"]
    assert three == pytest.approx((200 - 72 * 2 // 3) * 2**20, abs=1)  # abs: the estimate truncates to bytes
    seconds = {c.name: predict_seconds(c, facts, PEAKS, 1e10) for c in (none, half, blocks)}
    assert seconds[none.name] < seconds[half.name] < seconds[blocks.name]
    # recompute: a third of the step for every block, a sixth for every other one
    assert seconds[half.name] == pytest.approx(seconds[none.name] * (1 + 1 / 6))
    selective_half = estimate_memory(_plain("selective", 2), facts)["activation_bytes"]
    assert selective_half == (200 - 72 // 4) * 2**20  # selective's half of the saving, on half the blocks


def test_a_checkpoint_every_that_picks_the_same_blocks_as_a_smaller_one_is_pruned():
    facts = _facts()  # 2 blocks: every 2 and every 4 both checkpoint block 0 only
    space = enumerate_space(8, precisions=("fp32",), fusions=((),), compiles=("none",),
                            checkpoints=(None, "blocks", ("blocks", 4), ("blocks", 2), ("selective", 4)),
                            accumulates=(1,))
    left = prune(space, facts, _cpu("avx2"), peaks=PEAKS)
    by_name = {c.name: c for c in space}
    assert {c.name for c in left} == {"fp32", "fp32+ckpt:blocks", "fp32+ckpt:blocks/2", "fp32+ckpt:selective/4"}
    quarter = by_name["fp32+ckpt:blocks/4"]
    assert quarter.pruned_axis == "checkpoint" and "block 0 only" in quarter.reason
    assert "checkpoint_every=2" in quarter.reason
    assert pruned_axes(space) == [{"axis": "checkpoint", "values": ["blocks/4"], "reason": quarter.reason,
                                   "candidates": 1}]
    # one block: every other block is that block, so blocks stands for blocks/2
    space = enumerate_space(8)
    prune(space, _facts(block_count=1), _cpu("avx2", "avx512_bf16"), peaks=PEAKS)
    half = [c for c in space if c.checkpoint_every == 2 and not c.precision.startswith("fp16")]  # fp16: on precision
    assert half and all(c.pruned_axis == "checkpoint" and "as checkpoint_every=1 does" in c.reason for c in half)
    # on the two blocks of the default facts nothing in the default space duplicates another
    space = enumerate_space(8)
    prune(space, facts, _cpu("avx2", "avx512_bf16"), peaks=PEAKS)
    assert not any(c.pruned_axis == "checkpoint" for c in space)


def test_bf16_is_pruned_on_an_avx2_only_cpu_with_its_reason():
    space = enumerate_space(batch_rows=8)
    prune(space, _facts(), _cpu("avx2", "avx512f"), peaks=PEAKS)
    bf16 = [c for c in space if c.precision.startswith("bf16")]
    assert bf16 and all(c.status == "pruned" and c.pruned_axis == "precision" for c in bf16)
    assert "avx512_bf16" in bf16[0].reason and "emulated" in bf16[0].reason
    fp16 = [c for c in space if c.precision.startswith("fp16")]
    assert all(c.pruned_axis == "precision" and "CPU" in c.reason for c in fp16)


def test_bf16_survives_on_a_cpu_with_native_bf16_unless_it_measures_slower():
    space = enumerate_space(batch_rows=8)
    left = prune(space, _facts(), _cpu("avx2", "avx512_bf16"), peaks=PEAKS)
    assert any(c.precision == "bf16-master" for c in left)
    slower = hardware_reasons(_cpu("amx_bf16"), peaks={"fp32": 1e11, "bf16": 1e10})
    assert "bf16" in slower and "10.0x slower" in slower["bf16"]


def test_a_tiny_max_memory_prunes_the_big_micro_batches_but_never_the_baseline():
    facts = _facts()
    space = enumerate_space(batch_rows=8, precisions=("fp32",), fusions=((),), compiles=("none",),
                            checkpoints=(None,))
    by_acc = {c.accumulate: c for c in space}
    budget = (estimate_memory(by_acc[2], facts)["total_bytes"] + estimate_memory(by_acc[4], facts)["total_bytes"]) // 2
    left = prune(space, facts, _cpu("avx2"), peaks=PEAKS, max_memory=budget)
    assert by_acc[2].status == "pruned" and by_acc[2].pruned_axis == "memory" and "max_memory" in by_acc[2].reason
    assert by_acc[4] in left and by_acc[1] in left  # the baseline, over budget, stays: everything is compared to it
    assert by_acc[1].estimates["total_bytes"] > budget


def test_memory_estimate_follows_the_documented_model():
    facts = _facts()
    base = next(c for c in enumerate_space(batch_rows=8) if c.is_baseline)
    est = estimate_memory(base, facts)
    assert est["state_bytes"] == 16 * facts.params and est["activation_bytes"] == facts.activation_bytes
    blocks = next(c for c in enumerate_space(batch_rows=8) if c.checkpoint == "blocks" and c.precision == "fp32"
                  and not c.fusion and c.compile == "none" and c.accumulate == 1)
    kept = facts.activation_bytes - facts.block_saved_bytes + facts.block_input_bytes + facts.max_block_saved_bytes
    assert estimate_memory(blocks, facts)["activation_bytes"] == kept


def test_patterns_without_a_site_and_checkpointing_without_blocks_are_pruned_on_a_real_model():
    model_fn = lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))  # noqa: E731
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    facts = analyse(model_fn, nn.functional.cross_entropy, batch)
    assert facts.sites["linear_act"] == 1 and facts.sites["qkv"] == 0 and facts.params == 8 * 16 + 16 + 16 * 4 + 4
    assert facts.activation_bytes > 0 and facts.block_problem is not None
    space = enumerate_space(facts.batch_rows)
    prune(space, facts, _cpu("avx2"), peaks=PEAKS)
    qkv = next(c for c in space if c.fusion == ("qkv",) and c.precision == "fp32")
    assert qkv.pruned_axis == "fusion" and "no fusable qkv site" in qkv.reason
    ckpt = next(c for c in space if c.checkpoint == "blocks" and c.precision == "fp32" and not c.fusion)
    assert ckpt.pruned_axis == "checkpoint" and "block list" in ckpt.reason


def test_order_puts_the_baseline_first_and_sorts_by_the_ordering_model():
    facts = _facts()
    space = enumerate_space(batch_rows=8)
    ordered = order(prune(space, facts, _cpu("avx2"), peaks=PEAKS), facts, PEAKS, 1e10)
    assert ordered[0].is_baseline
    predicted = [c.estimates["predicted_seconds"] for c in ordered[1:]]
    assert all(a <= b + 1e-9 for a, b in zip(predicted, predicted[1:]))  # ties within 1e-9 s are ordered by simplicity
    assert ordered[1].compile != "none"  # the model takes compiling to move fewer bytes


# ---------------------------------------------------------------------------------- inputs and CLI
def test_durations_and_sizes_parse_and_bad_ones_raise():
    assert parse_duration("5m") == 300 and parse_duration("300s") == 300 and parse_duration("1.5h") == 5400
    assert parse_memory("8G") == 8 * 2**30 and parse_memory(None) is None
    for bad in ("5x", "", "-3m", "0"):
        with pytest.raises(ConfigError):
            parse_duration(bad)
    with pytest.raises(ConfigError):
        parse_memory("lots")


@pytest.mark.parametrize("argv", [
    ["tune", "--budget", "soon"],
    ["tune", "--budget", "5m", "--max-memory", "8Q"],
    ["tune", "--workload", "no-such-workload", "--budget", "5m"],
    ["bench", "--config-file", "/nonexistent/tuned.json", "--quick"],
])
def test_bad_input_exits_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"turbotrain {argv[0]}: error: ")


def test_bench_config_file_with_an_unknown_setting_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TUNED_ENV, raising=False)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"precision": "fp32", "no_such_field": 1}))
    assert main(["bench", "--config-file", str(path), "--quick"]) == 2
    assert "no_such_field" in capsys.readouterr().err


def test_lambdas_cannot_travel_to_the_workers_and_say_so(tmp_path):
    workload = user_workload(lambda: nn.Linear(2, 2), tiny_optimizer, tiny_batches())
    with pytest.raises(ConfigError, match="module-level functions"):
        save_payload(workload, tmp_path / "payload.pkl")


# ----------------------------------------------------------------------- the chosen Config trains
def test_micro_batches_split_a_batch_into_equal_rows():
    parts = split_batch({"input_ids": torch.zeros(8, 3), "labels": torch.ones(8, 3)}, 4)
    assert len(parts) == 4 and all(p["input_ids"].shape == (2, 3) for p in parts)
    with pytest.raises(ConfigError):
        split_batch((torch.zeros(6, 2), torch.zeros(6)), 4)


def test_a_tuned_config_round_trips_through_json_into_an_engine_that_trains(tmp_path, monkeypatch):
    cand = next(c for c in enumerate_space(4) if c.precision == "fp32" and c.fusion == ("linear_cross_entropy",)
                and c.compile == "none" and c.checkpoint == "blocks" and c.accumulate == 2)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(cand.config().to_dict()))
    config = Config.from_json(path.read_text())
    assert config == cand.config()
    workload = user_workload(tiny_model, tiny_optimizer, tiny_batches(count=12), loss_fn=tiny_loss)
    trainer = ConfigTrainer(workload, "cpu", config.to_dict())
    batches = workload.batches("train")
    first = [float(trainer.step(next(batches))) for _ in range(3)]
    later = [float(trainer.step(next(batches))) for _ in range(6)]
    assert trainer.engine.steps == 9  # accumulate=2: every batch split in two, one optimizer step
    assert sum(later[-3:]) / 3 < sum(first) / 3
    engine = Engine(tiny_model(), tiny_optimizer, tiny_loss, config=config.replace(device="cpu"))
    assert torch.isfinite(engine.step(tiny_batches()[0]).loss)

    monkeypatch.delenv(TUNED_ENV, raising=False)
    try:
        assert register_tuned_row(path) == TUNED_ROW
        assert os.environ[TUNED_ENV] == str(path.resolve())
        assert registry.get_config(TUNED_ROW).is_default_on("cpu")
    finally:
        forget_tuned_row()
    assert not registry.get_config(TUNED_ROW).is_default_on("cpu")


def test_a_tuned_every_other_block_config_round_trips_into_an_engine_that_checkpoints_block_0_only(tmp_path):
    facts = _facts()
    space = enumerate_space(4, precisions=("fp32",), fusions=((),), compiles=("none",), accumulates=(1,))
    order(prune(space, facts, _cpu("avx2"), peaks=PEAKS), facts, PEAKS, 1e10)
    winner = next(c for c in space if c.checkpoint_every == 2)
    winner.status = "measured"
    winner.measured = {"ratio_vs_baseline": 1.1, "ratio_ci95": [1.05, 1.15], "step_seconds": 0.5, "val_loss": 3.0,
                       "loss_delta_percent": 0.0, "loss_tolerance_percent": 0.2, "peak_memory_bytes": 2**20}
    doc = build_document(space, winner, facts, _cpu("avx2"), PEAKS, 1e10, TuneSettings(budget_s=10), _Named(), [1],
                         1.0)
    assert "blocks/2" in doc["space"]["axes"]["checkpoint"]
    write_reports(doc, winner, tmp_path)
    saved = json.loads((tmp_path / "tune.json").read_text())["winner"]
    assert saved["name"] == "fp32+ckpt:blocks/2" and saved["config"]["checkpoint_every"] == 2
    config = Config.from_json((tmp_path / "tuned.json").read_text())
    assert (config.checkpoint, config.checkpoint_every) == ("blocks", 2)
    workload = user_workload(tiny_model, tiny_optimizer, tiny_batches(count=4), loss_fn=tiny_loss)
    trainer = ConfigTrainer(workload, "cpu", config.to_dict())
    assert torch.isfinite(trainer.step(next(workload.batches("train"))))
    assert checkpointed_blocks(trainer.engine.module) == [("blocks.0", "blocks")]  # TinyNet's 2 blocks: the first
    # a tuned.json written before checkpoint_every existed loads as every block
    old = {k: v for k, v in Config(checkpoint="blocks").to_dict().items() if k != "checkpoint_every"}
    assert Config.from_dict(old).checkpoint_every == 1


def test_turbotrain_tune_is_callable_and_stays_the_package():
    import turbotrain.tune.search  # noqa: F401  (a submodule import must not replace the callable)

    assert callable(turbotrain.tune) and turbotrain.tune.__name__ == "turbotrain.tune"
    assert "tune" in turbotrain.__all__


# --------------------------------------------------------------------------------------- reports
def test_reports_without_matplotlib_say_so_once_and_keep_the_tables(tmp_path, monkeypatch, caplog):
    facts = _facts()
    space = enumerate_space(batch_rows=8, precisions=("fp32",), fusions=((),), compiles=("none",), checkpoints=(None,))
    order(prune(space, facts, _cpu("avx2"), peaks=PEAKS), facts, PEAKS, 1e10)
    base = space[0]
    base.status = "measured"
    base.measured = {"ratio_vs_baseline": 1.0, "ratio_ci95": [1.0, 1.0], "step_seconds": 0.5, "val_loss": 3.0,
                     "loss_delta_percent": 0.0, "loss_tolerance_percent": 0.2, "peak_memory_bytes": 2**20}
    for c in space[1:]:
        c.status, c.reason = "not reached", "the budget would be exceeded"
    doc = build_document(space, base, facts, _cpu("avx2"), PEAKS, 1e10, TuneSettings(budget_s=10), _Named(), [1], 1.0)
    priced = TuneSettings(budget_s=10, world_size=2, fit_json="net.json")  # the link's source is on record
    assert build_document(space, base, facts, _cpu("avx2"), PEAKS, 1e10, priced, _Named(), [1],
                          1.0)["settings"]["fit_json"] == "net.json"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level("WARNING", logger="turbotrain"):
        paths = write_reports(doc, base, tmp_path)
    assert sorted(p.name for p in paths) == ["tune.html", "tune.json", "tune.md", "tuned.json"]
    assert sum("matplotlib is not installed" in r.getMessage() for r in caplog.records) == 1
    page = (tmp_path / "tune.html").read_text()
    assert "matplotlib is not installed" in page and "<img" not in page and "fp32 (baseline)" in page
    assert Config.from_json((tmp_path / "tuned.json").read_text()) == Config()
    assert "Not reached within the budget" in (tmp_path / "tune.md").read_text()


class _Named:
    name, settings, description = "made-up", None, "no model"


# ----------------------------------------------------------------- the shadow check (workers run)
FUSED_OP_PLUGIN = textwrap.dedent('''
    # A fused Linear+activation registered in place of turbotrain's (patterns.py builds whatever
    # FusedLinearAct names). It computes in plain PyTorch (no compiled epilogue, so the test stays
    # short) and, when TT_TEST_OFFSET is set, is deliberately broken: right on each instance's first
    # call, so the fusion's verification (one call on a copy) passes it, then off by the offset,
    # the way a stale cache or a shape-dependent kernel bug goes wrong only in training.
    import os

    import torch.nn.functional as F
    from turbotrain.fusion import modules, patterns
    from turbotrain.fusion.ops._activations import activation_reference

    OFFSET = float(os.environ.get("TT_TEST_OFFSET", "0"))

    class PlainLinearAct(modules.FusedLinearAct):
        def forward(self, x):
            out = activation_reference(F.linear(x, self.weight, self.bias), self.act)
            calls = self.__dict__.get("_calls", 0)
            self.__dict__["_calls"] = calls + 1
            return out if calls == 0 else out + OFFSET

    patterns.FusedLinearAct = PlainLinearAct
''')


def _tiny_tune(tmp_path, name):
    workload = user_workload(tiny_model, tiny_optimizer, tiny_batches(count=6), loss_fn=tiny_loss)
    space = enumerate_space(4, precisions=("fp32",), fusions=((), ("linear_act",)), compiles=("none",),
                            checkpoints=(None,), accumulates=(1,))
    payload = save_payload(workload, tmp_path / f"{name}.pkl")
    settings = TuneSettings(budget_s=120, steps=2, rounds=2, warmup=1, val_batches=2, device="cpu")
    return run_tune(workload, settings, tmp_path / name, space=space,
                    workload_spec={"workload": "user", "payload": str(payload)})


@pytest.mark.slow
def test_a_fused_op_that_changes_the_loss_is_rejected_by_the_shadow_run(tmp_path, monkeypatch):
    (tmp_path / "tt_test_fused_op.py").write_text(FUSED_OP_PLUGIN)
    monkeypatch.setenv("TURBOTRAIN_BENCH_PLUGINS", "tt_test_fused_op")  # imported by every worker
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    sound = _tiny_tune(tmp_path, "sound")
    fused = next(c for c in sound.candidates if c.fusion == ("linear_act",))
    assert fused.status == "measured", fused.reason  # the check passes a sound fused op
    assert abs(fused.measured["loss_delta_percent"]) <= fused.measured["loss_tolerance_percent"]
    monkeypatch.setenv("TT_TEST_OFFSET", "0.5")
    broken = _tiny_tune(tmp_path, "broken")
    fused = next(c for c in broken.candidates if c.fusion == ("linear_act",))
    assert fused.status == "rejected" and "FP32 shadow run" in fused.reason and "tolerance" in fused.reason
    assert broken.winner.is_baseline
    doc = json.loads((tmp_path / "broken" / "tune.json").read_text())
    entry = next(c for c in doc["candidates"] if c["name"] == fused.name)
    assert entry["status"] == "rejected" and doc["loss_check"]["tolerance_percent"]["fp32"] > 0


# ----------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_a_quick_tune_writes_its_four_files_within_its_budget(tmp_path):
    out = tmp_path / "tune"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "turbotrain.cli", "tune", "--workload", "gpt", "--quick",
                           "--budget", "60s", "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=240)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["tune.html", "tune.json", "tune.md", "tuned.json"]
    doc = json.loads((out / "tune.json").read_text())
    assert doc["tuner_wall_seconds"] <= 60
    assert wall <= 60 + 15  # interpreter start and imports before the budget's clock starts
    statuses = {c["status"] for c in doc["candidates"]}
    assert "pruned" in statuses and doc["winner"]["status"] == "measured"
    assert any(c["baseline"] and c["status"] == "measured" for c in doc["candidates"])
    Config.from_json((out / "tuned.json").read_text())
    assert "winner" in proc.stdout and "tuned.json" in proc.stdout


def test_extra_rounds_go_to_the_candidates_not_yet_told_from_the_fastest():
    admission = _Admission({}, "fp32", TuneSettings(), end=0.0, reserve=0.0, rounds_end=0.0)

    def running(centre, spread=0.0, phase=0):
        return {"status": "running", "round_seconds": [[centre * (1 + spread * (-1) ** (i + phase))] for i in range(6)]}

    # close's rounds swing against fast's, so their paired ratio spans 1.0
    results = {"fp32": running(2.0), "fast": running(1.0, 0.05), "close": running(1.01, 0.05, phase=1),
               "slow": running(1.5, 0.01), "broken": {"status": "error"}}
    assert admission.more(results) == ["fast", "close"]  # slow's interval clears, the baseline takes no part
    assert admission.contenders == ["fast", "close"]
    results["close"] = running(1.3, 0.01)
    assert admission.more(results) == []  # the leader stands alone: no more extra rounds


def test_a_candidate_set_up_but_never_measured_is_not_reached_with_the_reason():
    candidate = enumerate_space(8)[1]
    base = {"status": "ok", "round_seconds": [[2.0]], "step_seconds": [2.0], "val_loss": 5.0}
    _record(candidate, {"status": "ok", "round_seconds": [], "step_seconds": []}, base, None)
    assert candidate.status == "not reached" and "before its first measured round" in candidate.reason
