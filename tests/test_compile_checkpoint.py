"""Compiled checkpointed blocks whose forward has a Python side effect stay one graph in the Engine.

A hook that records something (Hugging Face's output collector, a user's activation logger) mutates
state outside the checkpointed region; by default Dynamo breaks the graph at every such block and
runs it, and its recomputation, eagerly. The Engine's compile traces it whole and runs the side
effect once a forward.
"""

import pytest
import torch

from turbotrain import Config, Engine
from test_memory import TinyGPT, loss_fn, make_batch


def _counters():
    return torch._dynamo.utils.counters


def _engine_run(checkpoint, seen, steps=2):
    torch._dynamo.reset()
    _counters().clear()
    torch.manual_seed(0)
    model = TinyGPT().eval()
    for block in model.blocks:
        block.fc.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                    config=Config(device="cpu", compile=True, checkpoint=checkpoint))
    losses = [float(engine.step(make_batch(seed=i)).loss) for i in range(steps)]
    return losses, dict(_counters()["graph_break"])


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_a_hook_with_a_side_effect_does_not_break_the_compiled_checkpoint(mode):
    plain_seen, seen = [], []
    want, _ = _engine_run(None, plain_seen)
    got, breaks = _engine_run(mode, seen)
    assert breaks == {}
    assert len(seen) == len(plain_seen) == 3 * 2  # once per block per forward: not replayed in backward
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_without_the_setting_the_same_model_breaks_the_graph():
    # what the Engine's setting is for: a plain torch.compile of the checkpointed model breaks
    from turbotrain.memory import apply_checkpointing

    torch._dynamo.reset()
    _counters().clear()
    seen = []
    model = apply_checkpointing(TinyGPT().eval(), "selective")
    for block in model.blocks:
        block.fc.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    batch = make_batch()
    loss_fn(torch.compile(model)(batch[0]), batch[1]).backward()
    assert _counters()["graph_break"], "the side effect no longer breaks the graph: the setting may be moot"


def test_hf_llama_selective_checkpointing_compiles_whole():
    hf_models = pytest.importorskip("hf_models")
    batches = hf_models.batches("llama", 2)
    losses, breaks = {}, {}
    for mode in (None, "selective"):
        torch._dynamo.reset()
        _counters().clear()
        model = hf_models.build("llama")
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                        config=Config(device="cpu", compile=True, checkpoint=mode))
        losses[mode] = [float(engine.step(b).loss) for b in batches]
        breaks[mode] = dict(_counters()["graph_break"])
    assert breaks["selective"] == {}, breaks["selective"]
    torch.testing.assert_close(losses["selective"], losses[None], rtol=1e-5, atol=1e-6)
