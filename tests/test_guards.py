"""Guards while training (turbotrain/guards.py): the FP32 shadow check and self-healing precision.

The oracles are independent of the code under test: the shadow check's FP32 figures are checked
against a plain FP32 copy of the model built from the checkpoint's weights, and a healed run is
checked against a plain FP32 run on the same batches.
"""

import copy
import json
import logging
import math
import warnings

import pytest
import torch
from torch import nn

from test_engine import tiny_batches as batches

import turbotrain
from turbotrain import Config, ConfigError, Engine, GuardConfig, LossScaleConfig, PrecisionDriftError, \
    PrecisionDriftWarning, TurbotrainError

F = nn.functional
_LOW = (torch.bfloat16, torch.float16)


class Net(nn.Module):
    """Linear -> block -> LayerNorm -> Linear classifier; ``block`` is where a test plants its fault."""

    def __init__(self, block=None, dropout=0.0, batchnorm=False):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.block = block if block is not None else Plain()
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.inp(x))))
        return self.out(self.norm(h + self.block(h)))


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x)


class ScaledInLowPrecision(Plain):
    """Flips and triples its output only when it computes in bf16/fp16: a drift FP32 never sees."""

    def forward(self, x):
        y = self.lin(x)
        return y * -3.0 if y.dtype in _LOW else y


class OverflowsInFp16(nn.Module):
    """Its intermediate passes fp16's 65504 (forward), while its output is O(1): FP32 computes it fine."""

    def __init__(self):
        super().__init__()
        self.lin, self.lin2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.lin2(self.lin(x) * 1e6) / 1e6


class _AmplifyGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by 1e6 (overflows fp16, not FP32)."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e6


class GradOverflowsInFp16(nn.Module):
    """Its weight's gradient overflows fp16 at any loss scale >= 1; the gradient it passes on is ordinary.
    Adam's update is invariant to the 1e6 factor, so FP32 trains it normally."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 32**0.5)

    def forward(self, x):
        return F.linear(x, _AmplifyGrad.apply(self.weight))


def engine_for(model, **config):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Engine(model, opt, F.cross_entropy, config=Config(device="cpu", **config))


def drift_warnings(record):
    return [w for w in record if issubclass(w.category, PrecisionDriftWarning)]


def fp32_loss_and_norm(engine, model_fn, batch):
    """The oracle: a plain FP32 copy of the model from the Engine's checkpointed weights."""
    ref = model_fn()
    ref.load_state_dict(engine.state_dict()["model"])
    ref.train()
    loss = F.cross_entropy(ref(batch[0]), batch[1])
    grads = torch.autograd.grad(loss, [p for p in ref.parameters()])
    return float(loss), float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


# -- configuration -----------------------------------------------------------------------------
def test_guard_config_round_trips_and_defaults_are_off():
    assert Config().guards is None
    assert Config(guards=True).guards == GuardConfig()
    assert Config(guards=False).guards is None
    cfg = Config(precision="bf16-master", guards=GuardConfig(shadow_every=7, max_loss_gap=0.05, action="stop",
                                                             heal=False, floor_steps=4))
    d = cfg.to_dict()
    assert d["guards"] == {"shadow_every": 7, "max_loss_gap": 0.05, "max_grad_norm_gap": 0.1, "action": "stop",
                           "heal": False, "floor_steps": 4}
    assert Config.from_dict(d) == cfg
    assert Config.from_json(json.dumps(d)) == cfg
    assert Config.from_json(json.dumps({"guards": {"shadow_every": None}})).guards.shadow_every is None


@pytest.mark.parametrize("settings, match", [
    ({"shadow_every": 0}, "shadow_every=0"),
    ({"shadow_every": 2.5}, "integer"),
    ({"max_loss_gap": 0}, "max_loss_gap=0"),
    ({"max_grad_norm_gap": -0.1}, "max_grad_norm_gap"),
    ({"action": "halt"}, "'warn', 'stop'"),
    ({"heal": "yes"}, "True or False"),
    ({"floor_steps": 0}, "floor_steps"),
])
def test_guard_config_rejects_bad_values(settings, match):
    with pytest.raises(ConfigError, match=match):
        GuardConfig(**settings)


def test_config_rejects_bad_guards():
    with pytest.raises(ConfigError, match="GuardConfig"):
        Config(guards="on")
    with pytest.raises(ConfigError, match="unknown guards setting.*'every'"):
        Config.from_dict({"guards": {"every": 5}})
    # the scaler would give up (LossScaleError) before healing at that count
    with pytest.raises(ConfigError, match="max_floor_overflows"):
        Config(guards=GuardConfig(floor_steps=10), loss_scale=LossScaleConfig(max_floor_overflows=10))
    Config(guards=GuardConfig(floor_steps=10, heal=False), loss_scale=LossScaleConfig(max_floor_overflows=10))


# -- the FP32 shadow check -----------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-master"])
def test_shadow_check_warns_on_drift_with_fp32_figures_of_the_same_weights(precision):
    torch.manual_seed(0)
    make = lambda: Net(ScaledInLowPrecision())  # noqa: E731
    engine = engine_for(make(), precision=precision, guards=GuardConfig(shadow_every=2))
    data = batches(3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i, batch in enumerate(data):
            # due at optimizer steps 0 and 2; the oracle reads the weights before the step changes them
            oracle = fp32_loss_and_norm(engine, make, batch) if i in (0, 2) else None
            stats = engine.step(batch)
            if oracle is None:
                assert stats.shadow is None
                continue
            check = stats.shadow
            assert check is not None and check.step == i and engine.guards.last is check
            assert check.fp32_loss == pytest.approx(oracle[0], rel=1e-5)
            assert check.fp32_grad_norm == pytest.approx(oracle[1], rel=1e-4)
            assert "loss" in check.exceeded and check.loss_gap > 0.02
    drifts = drift_warnings(record)
    assert len(drifts) == 2  # once per failing check
    assert "max_loss_gap 0.02" in str(drifts[0].message) and "turbotrain diagnose precision" in str(drifts[0].message)


def test_shadow_check_bounds_the_gradient_norm_on_its_own():
    torch.manual_seed(0)
    engine = engine_for(Net(ScaledInLowPrecision()), precision="bf16-mixed",
                        guards=GuardConfig(shadow_every=1, max_loss_gap=1e9))
    with pytest.warns(PrecisionDriftWarning, match="gradient-norm gap .* > max_grad_norm_gap 0.1"):
        stats = engine.step(batches(1)[0])
    assert stats.shadow.exceeded == ("grad_norm",)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-master", "fp16-master"])
def test_shadow_check_is_silent_on_a_clean_run(precision):
    torch.manual_seed(0)
    engine = engine_for(Net(), precision=precision, guards=GuardConfig(shadow_every=1))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        checks = [engine.step(b).shadow for b in batches(4)]
    assert not drift_warnings(record)
    assert all(c is not None and not c.exceeded for c in checks)
    assert all(c.grad_norm is not None and c.grad_norm_gap < 0.1 and c.loss_gap < 0.02 for c in checks)
    assert max(c.loss_gap for c in checks) > 0  # it did compare two different computations


def test_action_stop_raises_naming_gap_bound_and_fix():
    torch.manual_seed(0)
    engine = engine_for(Net(ScaledInLowPrecision()), precision="bf16-master",
                        guards=GuardConfig(shadow_every=1, action="stop"))
    before = copy.deepcopy(engine.module.state_dict())
    with pytest.raises(PrecisionDriftError, match=r"loss gap .* > max_loss_gap 0\.02 .*keep them FP32") as info:
        engine.step(batches(1)[0])
    assert isinstance(info.value, TurbotrainError)
    assert engine.steps == 0  # the step did not happen
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_shadow_check_leaves_the_run_bitwise_unchanged(accumulate):
    """Same gradients, optimizer state and RNG stream (dropout, BatchNorm) with the check as without it."""
    runs = []
    for guards in (None, GuardConfig(shadow_every=1)):
        torch.manual_seed(3)
        engine = engine_for(Net(dropout=0.2, batchnorm=True), precision="bf16-master", accumulate=accumulate,
                            guards=guards)
        losses = [float(engine.step(b).loss) for b in batches(6, batch=16)]
        runs.append((losses, engine.state_dict(), torch.rand(3)))
    (l0, s0, r0), (l1, s1, r1) = runs
    assert l0 == l1 and torch.equal(r0, r1)
    for k in s0["model"]:
        assert torch.equal(s0["model"][k], s1["model"][k]), k
    for k, state in s0["optimizer"]["state"].items():
        for name, t in state.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(s1["optimizer"]["state"][k][name])), (k, name)


def test_shadow_check_costs_nothing_when_not_due():
    torch.manual_seed(0)
    model = Net()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    engine = engine_for(model, precision="bf16-master", guards=GuardConfig(shadow_every=3))
    due = [engine.step(b).shadow is not None for b in batches(7)]
    assert due == [True, False, False, True, False, False, True]
    assert len(forwards) == 7 + 3


def test_shadow_check_is_off_in_fp32_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="turbotrain.guards"):
        engine = engine_for(Net(), guards=GuardConfig(shadow_every=1))
        assert engine.step(batches(1)[0]).shadow is None
    assert "nothing to compare" in caplog.text


# -- self-healing precision ---------------------------------------------------------------------
def dtypes_inside(engine, path):
    seen = {}
    module = engine.module.get_submodule(path)
    handle = module.register_forward_hook(lambda m, args, out: seen.update(inp=args[0].dtype, out=out.dtype))
    with torch.no_grad(), engine.autocast():
        engine.module(batches(1)[0][0])
    handle.remove()
    params = {p.dtype for p in module.parameters()}
    return seen, params


def eval_loss(engine, n=4):
    return engine.eval_loss(batches(n, seed=99))


def fp32_reference(model_fn, data, seed):
    torch.manual_seed(seed)
    ref = engine_for(model_fn())
    for b in data:
        ref.step(b)
    return eval_loss(ref)


#: fp16 keeps 11 significant bits: the project's fp16-master loss tolerance against FP32 (test_engine_matrix).
FP16_LOSS_TOLERANCE = 0.01
#: bf16 keeps 8 significant bits: the bf16 tolerance.
BF16_LOSS_TOLERANCE = 0.02


@pytest.mark.parametrize("precision", ["fp16-master", "fp16-mixed"])
def test_a_module_the_nan_finder_names_twice_moves_to_fp32_and_survives_save_load(precision, tmp_path, caplog):
    torch.manual_seed(5)
    data = batches(24)
    engine = engine_for(Net(OverflowsInFp16()), precision=precision, nan_check=True,
                        guards=GuardConfig(shadow_every=None))
    with caplog.at_level(logging.WARNING, logger="turbotrain.guards"):
        first = [engine.step(b) for b in data[:3]]
    assert [s.skipped for s in first] == [True, True, False]
    assert "named once" in first[0].skip_reason and "block now runs in FP32" in first[1].skip_reason
    assert engine.precision.fp32_modules == ["block"]
    assert "block -> FP32" in caplog.text and "named it twice" in caplog.text
    seen, params = dtypes_inside(engine, "block")
    assert params == {torch.float32}
    assert seen["out"] == (torch.float16 if precision == "fp16-master" else torch.float32)
    assert engine.guards.heals[0]["change"] == "block -> FP32"

    resumed = resume(engine, tmp_path / "ck.pt")
    assert resumed.precision.fp32_modules == ["block"]
    assert resumed.guards.heals == engine.guards.heals
    rest = [resumed.step(b) for b in data[3:]]
    assert not any(s.skipped for s in rest) and all(math.isfinite(float(s.loss)) for s in rest)
    # the two skipped steps changed nothing, so the FP32 run trains on the other batches
    reference = fp32_reference(lambda: Net(OverflowsInFp16()), data[2:], seed=5)
    assert abs(eval_loss(resumed) - reference) / reference < FP16_LOSS_TOLERANCE


def floor_run(seed, caplog, data):
    """fp16-master with the loss scale at its floor from the start and a weight gradient fp16 cannot hold:
    the first two steps overflow at the floor, healing runs after the second."""
    torch.manual_seed(seed)
    floor = LossScaleConfig(init_scale=2.0**10, min_scale=2.0**10, max_floor_overflows=5)
    engine = engine_for(Net(GradOverflowsInFp16()), precision="fp16-master", loss_scale=floor,
                        guards=GuardConfig(shadow_every=None, floor_steps=2))
    with caplog.at_level(logging.WARNING, logger="turbotrain.guards"):
        first = [engine.step(b) for b in data[:3]]
    assert [s.skipped for s in first] == [True, True, False]
    return engine, first


def resume(engine, path):
    engine.save(path)
    model = Net(type(engine.module.block)())
    return Engine.load(path, model, torch.optim.AdamW(model.parameters(), lr=1e-2), F.cross_entropy,
                       config=engine.config)


def test_the_loss_scale_floor_moves_the_module_the_finder_names_to_fp32(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(turbotrain.guards, "_bf16_native", lambda device: None)  # an fp16-only GPU, say
    data = batches(24)
    engine, _ = floor_run(7, caplog, data)
    assert engine.precision.fp32_modules == ["block"]
    assert "sat at its floor (1024) for 2 overflowing steps" in caplog.text and "block -> FP32" in caplog.text
    resumed = resume(engine, tmp_path / "ck.pt")
    assert resumed.precision.fp32_modules == ["block"]
    assert dtypes_inside(resumed, "block")[1] == {torch.float32}
    rest = [resumed.step(b) for b in data[3:]]
    assert not any(s.skipped for s in rest)
    reference = fp32_reference(lambda: Net(GradOverflowsInFp16()), data[2:], seed=7)
    assert abs(eval_loss(resumed) - reference) / reference < FP16_LOSS_TOLERANCE


def test_the_loss_scale_floor_switches_fp16_to_bf16_where_bf16_is_native(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(turbotrain.guards, "_bf16_native", lambda device: "a test's native bf16")
    data = batches(24)
    engine, first = floor_run(8, caplog, data)
    assert engine.precision.mode == "bf16-master" and engine.precision.scaler is None
    assert first[2].loss_scale is None
    assert "fp16-master -> bf16-master" in caplog.text
    assert {p.dtype for p in engine.module.block.parameters()} == {torch.bfloat16}
    resumed = resume(engine, tmp_path / "ck.pt")  # its config still says fp16-master
    assert resumed.precision.mode == "bf16-master" and resumed.precision.switched_from == "fp16-master"
    rest = [resumed.step(b) for b in data[3:]]
    assert not any(s.skipped for s in rest)
    reference = fp32_reference(lambda: Net(GradOverflowsInFp16()), data[2:], seed=8)
    assert abs(eval_loss(resumed) - reference) / reference < BF16_LOSS_TOLERANCE


class _Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x) * 1e6  # its own output passes fp16's range: FP32 inside it cannot help


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = _Big()

    def forward(self, x):
        return self.big(x) / 1e6


def test_a_healed_module_named_again_hands_healing_to_its_parent():
    torch.manual_seed(5)
    engine = engine_for(Net(_Outer()), precision="fp16-master", nan_check=True,
                        guards=GuardConfig(shadow_every=None))
    skipped = [engine.step(b).skipped for b in batches(6)]
    assert skipped == [True, True, True, True, False, False]
    assert engine.precision.fp32_modules == ["block.big", "block"]
    assert [h["change"] for h in engine.guards.heals] == ["block.big -> FP32", "block -> FP32"]


def test_without_heal_an_overflow_still_stops_the_run():
    torch.manual_seed(5)
    engine = engine_for(Net(OverflowsInFp16()), precision="fp16-master", nan_check=True,
                        guards=GuardConfig(shadow_every=None, heal=False))
    with pytest.raises(TurbotrainError, match="inf/NaN appeared at optimizer step 0"):
        engine.step(batches(1)[0])
    assert engine.precision.fp32_modules == []
