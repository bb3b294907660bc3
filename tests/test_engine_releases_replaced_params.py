"""Once the Engine is set up it holds no Parameter the model stopped using.

Fusion concatenates q/k/v (and gate/up) into new Parameters; the stock ones must then be freed with
the user's own references, while the stock-layout optimizer state (keyed by their names, cut to their
rows) still saves and loads. The sharded case (FSDP2 replacing every parameter by its shard, and the
memory a rank keeps) runs on two gloo ranks in tests/test_parallel_dist.py
(sc_engine_lets_go_of_the_unsharded_model).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from turbotrain import Config, Engine
from turbotrain.workloads import get_workload

SHAPE = dict(d=32, n_layer=2, n_head=4, T=16, B=4, vocab_size=512)
#: The projections each family's fused patterns concatenate into one Parameter.
FUSED = {"gpt": (("qkv",), ("q_proj", "k_proj", "v_proj")),
         "llama": (("qkv", "swiglu"), ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}


def _work(name):
    work = get_workload(name, **SHAPE)
    stream = work.batches("train", seed=0)
    return work, [next(stream) for _ in range(2)]


def _stock_refs(model, name) -> dict:
    """Weak references to the parameters fusion will replace, by name (the caller holds none of them)."""
    projections = FUSED[name][1]
    return {n: weakref.ref(p) for n, p in model.named_parameters() if n.split(".")[-2] in projections}


def _alive(refs: dict) -> list[str]:
    gc.collect()
    return [n for n, ref in refs.items() if ref() is not None]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fused_stock_parameters_are_freed_once_the_engine_is_set_up(name):
    work, data = _work(name)
    model = work.build_model()
    refs = _stock_refs(model, name)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), work.loss_fn,
                    config=Config(device="cpu", fuse=FUSED[name][0]))
    assert len(_alive(refs)) == len(refs) > 0  # before set-up the model still holds them
    engine.step(data[0])  # fusion sets up at the first step
    assert engine.fusion_report.fused and not set(refs) & {n for n, _ in model.named_parameters()}
    assert _alive(refs) == []
    engine.step(data[1])
    assert _alive(refs) == []


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_stock_layout_optimizer_state_outlives_the_stock_parameters(name):
    """Saved by the stock names and cut to the stock rows: an unfused run's AdamW state, the oracle."""
    work, data = _work(name)
    torch.manual_seed(0)
    plain = work.build_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    work.loss_fn(plain(data[0][0]), data[0][1]).backward()
    plain_opt.step()
    want = {n: plain_opt.state[p] for n, p in plain.named_parameters()}

    torch.manual_seed(0)
    model = work.build_model()
    refs = _stock_refs(model, name)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), work.loss_fn,
                    config=Config(device="cpu", fuse=FUSED[name][0]))
    engine.step(data[0])
    assert _alive(refs) == []
    got = engine.state_dict()["optimizer"]
    assert set(got["state"]) == set(want)  # every stock name
    for n in want:
        for key in ("exp_avg", "exp_avg_sq"):
            # fused and unfused GEMMs sum in another order: equal to fp32 rounding, not bitwise
            torch.testing.assert_close(got["state"][n][key], want[n][key], rtol=1e-4, atol=1e-9,
                                       msg=lambda m: f"{n} {key}: {m}")

    # and back onto a fused Engine: after its set-up, and before it (applied when fusion sets up, at the
    # first step, which then goes on as the saved Engine's next step does)
    saved = engine.state_dict()
    engine.step(data[1])
    for loaded_before_setup in (False, True):
        torch.manual_seed(0)
        again = work.build_model()
        resumed = Engine(again, torch.optim.AdamW(again.parameters(), lr=1e-2), work.loss_fn,
                         config=Config(device="cpu", fuse=FUSED[name][0]))
        if loaded_before_setup:
            resumed.load_state_dict(saved)
            resumed.step(data[1])
            expected = engine.state_dict()["optimizer"]["state"]
        else:
            resumed.step(data[1])
            resumed.load_state_dict(saved)
            expected = saved["optimizer"]["state"]
        back = resumed.state_dict()["optimizer"]["state"]
        assert set(back) == set(want)
        for n in want:
            torch.testing.assert_close(back[n]["exp_avg"], expected[n]["exp_avg"], rtol=0, atol=0,
                                       msg=lambda m: f"{n}: {m}")


def test_fp32_masters_stay_keyed_by_the_live_low_precision_parameters():
    """bf16-master over fused q/k/v: the plan keeps each live bf16 weight's master, and nothing fused away."""
    work, data = _work("gpt")
    model = work.build_model()
    refs = _stock_refs(model, "gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine(model, opt, work.loss_fn, config=Config(device="cpu", precision="bf16-master", fuse=("qkv",)))
    engine.step(data[0])
    assert _alive(refs) == []
    live = {p: n for n, p in model.named_parameters()}
    masters = engine.plan.master_of
    assert masters and all(p in live and p.dtype == torch.bfloat16 for p in masters)
    assert any(live[p].endswith("qkv_fused.weight") for p in masters)
    stepped = {p for g in opt.param_groups for p in g["params"]}
    assert all(m in stepped and m.dtype == torch.float32 for m in masters.values())
    assert engine.plan.fused_from == {}
    assert all(p in live for p in engine.plan.norm_params)
