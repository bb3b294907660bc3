"""Vocabulary-parallel loss (``ParallelConfig(loss_parallel=True)``, torch's ``loss_parallel()``), 2 gloo ranks.

The head's logits stay a DTensor sharded over the vocabulary and the Engine's loss (a loss_fn's
``F.cross_entropy``, or a Hugging Face model's own ``labels=`` loss with its ignored padding) is
computed on the shards. Each run is checked against the oracle of test_parallel_dist (plain torch:
the unsharded model, the whole batch, AdamW; ``reference``) and against the same sharded run with
``loss_parallel=False``, whose logits are gathered first. Spawned with test_parallel_dist's helpers.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from hf_models import VOCAB as HF_VOCAB
from test_parallel_dist import (
    GPT, LR, WORLD, cfg, drive, full, hf_batches, hf_llama, lm_loss, reference, result, spawn, text_batches, workload,
)

pytestmark = pytest.mark.dist

STEPS = 5
TIMEOUT_S = 300
# fp32 sums in another order (split heads, the sharded log-softmax's max and sum of exponentials):
# the losses agree to the last bits the existing tensor-parallel tests allow (test_parallel_dist).
FP32_LOSS = dict(rtol=1e-5, atol=1e-6)
VOCAB = {"gpt": GPT["vocab_size"], "hf": HF_VOCAB}


def _gpt():
    """(model, loss_fn, batches): turbotrain's gpt workload, its cross_entropy_loss."""
    wl = workload()
    return wl.build_model(), wl.loss_fn, text_batches(n=STEPS)


def _hf():
    """(model, loss_fn, batches): a tiny HF LlamaForCausalLM, its own labels= loss, padded rows."""
    return hf_llama(), None, hf_batches(n=STEPS)


SETUPS = {"gpt": _gpt, "hf": _hf}


def _engine(model, loss_fn, parallel):
    from turbotrain import Config, Engine

    return Engine(model, torch.optim.AdamW(model.parameters(), lr=LR), loss_fn,
                  config=Config(parallel=parallel, device="cpu"))


def _logits_seen(engine):
    """What the head hands on, recorded once per forward: (DTensor?, placements, local shape)."""
    from torch.distributed.tensor import DTensor

    seen = []

    def record(module, args, output):
        seen.append((isinstance(output, DTensor), str(getattr(output, "placements", None)),
                     tuple((output.to_local() if isinstance(output, DTensor) else output).shape)))

    engine.module.lm_head.register_forward_hook(record)
    return seen


def _all_gathers(engine, batch) -> tuple[int, int]:
    """(all-gathers, bytes they return) of one more training step, forward and backward."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Gathers(TorchDispatchMode):
        # CommDebugMode's way, without its module tracker (which trips on the HF model's hooks): returning
        # NotImplemented on a DTensor op lets DTensor desugar it into local ops and collectives first.
        count, nbytes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            if "all_gather" in func.name() or "allgather" in func.name():
                self.count += 1
                self.nbytes += out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0
            return out

    with Gathers() as mode:
        engine.step(batch)
    return mode.count, mode.nbytes


def _run(setup, loss_parallel, sequence_parallel):
    model, loss_fn, batches = SETUPS[setup]()
    engine = _engine(model, loss_fn, cfg(tp=2, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel))
    seen = _logits_seen(engine)
    stats = [engine.step(b) for b in batches]
    return {"losses": [s.loss.item() for s in stats], "plain": all(type(s.loss) is torch.Tensor for s in stats),
            "logits": seen[0], "eval": engine.eval_loss(batches[:1]), "gathers": _all_gathers(engine, batches[0]),
            "notes": engine.plan.notes}


def _name(setup, loss_parallel, sequence_parallel):
    return f"sc_{setup}_{'sp' if sequence_parallel else 'tp'}_{'lp' if loss_parallel else 'gathered'}"


@dataclass(frozen=True)
class Run:
    """One scenario per (setup, loss_parallel, sequence_parallel): a picklable callable the ranks run by name."""

    setup: str
    loss_parallel: bool
    sequence_parallel: bool

    @property
    def __name__(self) -> str:
        return _name(self.setup, self.loss_parallel, self.sequence_parallel)

    def __call__(self, info, shared):
        return _run(self.setup, self.loss_parallel, self.sequence_parallel)


RUNS = [(s, lp, sp) for s in SETUPS for sp in (False, True) for lp in (True, False)]


def _masked_loss(out, targets):
    """A per-token loss times a plain mask: math on the logits' loss that DTensor cannot mix with a tensor."""
    per_token = F.cross_entropy(out.float().flatten(0, 1), targets.flatten(), reduction="none")
    mask = torch.ones_like(targets.flatten(), dtype=per_token.dtype)
    return (per_token * mask).sum() / mask.sum()


def sc_unsupported_loss(info, shared):
    """A loss loss_parallel cannot run: a ConfigError naming the switch, then the Engine trains on."""
    from turbotrain import ConfigError

    wl = workload()
    use = {"loss": _masked_loss}
    engine = _engine(wl.build_model(), lambda out, y: use["loss"](out, y), cfg(tp=2))
    batches = text_batches(n=2)
    try:
        engine.step(batches[0])
        error = None
    except ConfigError as exc:
        error = str(exc)
    with torch.no_grad():  # outside the Engine's step: torch's cross-entropy handlers were taken off again
        logits = engine.module(batches[0][0])
    try:
        F.cross_entropy(logits.flatten(0, 1), batches[0][1].flatten())
        left_on = True
    except RuntimeError:  # DTensor alone does not mix the sharded logits with plain targets
        left_on = False
    use["loss"] = wl.loss_fn
    after = [engine.step(b).loss.item() for b in batches]
    gathered = _engine(wl.build_model(), _masked_loss, cfg(tp=2, loss_parallel=False))
    return {"error": error, "after": after, "steps": engine.steps, "left_on": left_on,
            "outside": type(logits).__name__,
            "gathered": [gathered.step(b).loss.item() for b in batches]}


def sc_first_gradients(info, shared):
    """Every parameter's gradient of one backward through loss_parallel (no optimizer to amplify noise)."""
    out = {}
    for setup in SETUPS:
        for sp in (False, True):
            model, _, batches = SETUPS[setup]()
            t, _, _ = drive(model, cfg(tp=2, sequence_parallel=sp))
            with t.accumulate_context(True):
                lm_loss(model, batches[0]).backward()
            out[setup, sp] = {n: full(p.grad).clone() for n, p in model.named_parameters()}
    return out


SCENARIOS = [*(Run(*run) for run in RUNS), sc_unsupported_loss, sc_first_gradients]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(WORLD, SCENARIOS, tmp_path_factory.mktemp("parallel_loss"), {}, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def oracle():
    """setup -> the single-process losses (plain torch)."""
    out = {}
    for name, setup in SETUPS.items():
        torch.manual_seed(0)  # as every scenario starts (test_parallel_dist's worker)
        model, _, batches = setup()
        out[name] = reference(model, batches, steps=STEPS)["losses"]
    return out


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_sharded_loss_matches_one_process_and_the_gathered_logits(ranks, oracle, setup, sequence_parallel):
    sharded = result(ranks, _name(setup, True, sequence_parallel))
    gathered = result(ranks, _name(setup, False, sequence_parallel))
    for lp, gp in zip(sharded, gathered):
        torch.testing.assert_close(lp["losses"], oracle[setup], **FP32_LOSS)
        torch.testing.assert_close(lp["losses"], gp["losses"], **FP32_LOSS)
        assert lp["plain"] and gp["plain"]  # StepStats.loss is a plain tensor either way
        torch.testing.assert_close(lp["eval"], gp["eval"], **FP32_LOSS)  # eval_loss runs under loss_parallel too
    assert sharded[0]["losses"] == sharded[1]["losses"]  # the pair computes one loss


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_gradients_through_the_sharded_loss_match_one_process(ranks, setup, sequence_parallel):
    torch.manual_seed(0)
    model, _, batches = SETUPS[setup]()
    lm_loss(model, batches[0]).backward()
    largest = max(p.grad.abs().max() for p in model.parameters())
    for r in result(ranks, "sc_first_gradients"):
        got = r[setup, sequence_parallel]
        for name, p in model.named_parameters():
            # fp32 sums in another order: measured under 1e-6 of each tensor's largest gradient. A gradient
            # that is zero in exact arithmetic (a key bias, which softmax cancels) is rounding alone, so the
            # scale it is measured against is at least 1/100 of the model's largest gradient.
            scale = max(p.grad.abs().max(), 1e-2 * largest)
            worst = (got[name] - p.grad).abs().max() / scale
            assert worst < 1e-5, f"{name}: {worst:.1e} of its largest gradient"


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_logits_stay_sharded_over_the_vocabulary(ranks, setup, sequence_parallel):
    vocab = VOCAB[setup]
    for lp, gp in zip(result(ranks, _name(setup, True, sequence_parallel)),
                      result(ranks, _name(setup, False, sequence_parallel))):
        is_dtensor, placements, local = lp["logits"]
        assert is_dtensor and "Shard(dim=2)" in placements and local[-1] == vocab // WORLD
        assert gp["logits"][0] is False and gp["logits"][2][-1] == vocab  # gathered: plain, whole vocabulary
        # the one all-gather a step no longer issues: the (B, T, V) fp32 logits
        tokens = (text_batches(n=1)[0][0] if setup == "gpt" else hf_batches(n=1)[0]["input_ids"]).numel()
        (gathers, gathered_bytes), (sharded, sharded_bytes) = gp["gathers"], lp["gathers"]
        assert (gathers - sharded, gathered_bytes - sharded_bytes) == (1, tokens * vocab * 4)
        assert any("loss_parallel" in n and "sharded over the vocabulary" in n for n in lp["notes"])
        assert any("logits gathered for the loss (loss_parallel=False)" in n for n in gp["notes"])


def test_no_fsdp_view_warning_with_sharded_logits(ranks):
    for name in (_name(*run) for run in RUNS):
        for r in result(ranks, name):
            assert not [w for w in r["warnings"] if "returned a view tensor" in w], name


def test_a_loss_loss_parallel_cannot_run_names_the_switch_and_leaves_the_engine_usable(ranks, oracle):
    for r in result(ranks, "sc_unsupported_loss"):
        assert r["error"] is not None and "ParallelConfig(loss_parallel=False)" in r["error"]
        assert "got mixed torch.Tensor and DTensor" in r["error"]  # torch's own words, kept
        assert r["steps"] == 2  # the failed micro-batch took no step; the next two trained
        assert not r["left_on"] and r["outside"] == "DTensor"  # called directly, the model hands out the shards
        torch.testing.assert_close(r["after"], oracle["gpt"][:2], **FP32_LOSS)
        torch.testing.assert_close(r["gathered"], oracle["gpt"][:2], **FP32_LOSS)  # the switch it names works


def test_scenarios_stay_quick(ranks):
    slowest = max((r[name]["seconds"], name) for r in ranks for name in r)
    assert slowest[0] < 30, slowest


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_loss_parallel_must_be_a_bool(value):
    from turbotrain import ConfigError
    from turbotrain.parallel import ParallelConfig

    with pytest.raises(ConfigError, match="loss_parallel=.* must be True or False"):
        ParallelConfig(tp=2, loss_parallel=value)


def test_loss_parallel_is_on_by_default_and_switchable():
    from turbotrain.parallel import ParallelConfig

    assert ParallelConfig(tp=2).loss_parallel is True
    assert ParallelConfig(tp=2, loss_parallel=False).loss_parallel is False
    assert ParallelConfig(loss_parallel=True).tp == 1  # without tensor parallel it has nothing to do


def test_loss_parallel_round_trips_through_config():
    import json

    from turbotrain import Config
    from turbotrain.parallel import ParallelConfig

    config = Config(parallel=ParallelConfig(tp=2, loss_parallel=False))
    assert config.to_dict()["parallel"]["loss_parallel"] is False
    assert Config.from_json(json.dumps(config.to_dict())) == config
