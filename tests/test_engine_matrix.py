"""Every transform with every other: precision x fusion x checkpointing x keep_fp32_head (x compile),
on turbotrain's gpt and on HF Llama. Each run is checked against the FP32 run on the same batches,
for the dtypes the plan promises (norms and the head FP32), and for a state_dict that loads into
the stock model."""

import itertools

import pytest
import torch

from turbotrain import Config, Engine
from turbotrain.workloads import get_workload

from hf_models import batches as hf_batches
from hf_models import build as hf_build

STEPS = 6
PRECISIONS = ("bf16-master", "bf16-mixed", "fp16-master")
#: Loss after STEPS steps vs the FP32 run, per precision (relative). The models are at ~ln(V) after
#: six steps, where bf16's 8-bit mantissa moves the loss by a few 1e-3.
LOSS_TOLERANCE = {"bf16-master": 0.02, "bf16-mixed": 0.02, "fp16-master": 0.01}


def gpt_case():
    work = get_workload("gpt", d=64, n_layer=2, n_head=4, T=32, B=4, vocab_size=512)
    stream = work.batches("train", seed=0)
    data = [next(stream) for _ in range(STEPS)]
    return work.build_model, work.loss_fn, data


def llama_case():
    return (lambda: hf_build("llama")), None, hf_batches("llama", STEPS)


CASES = {"gpt": gpt_case, "hf-llama": llama_case}
_cache = {}


def case(name):
    if name not in _cache:
        _cache[name] = CASES[name]()
    return _cache[name]


def run(name, **settings):
    build, loss_fn, data = case(name)
    torch.manual_seed(0)
    model = build()
    stock_keys = set(model.state_dict())
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn,
                    config=Config(device="cpu", **settings))
    losses = [float(engine.step(b).loss) for b in data]
    return engine, losses, build, stock_keys


_reference = {}


def reference(name):
    if name not in _reference:
        _reference[name] = run(name)[1]
    return _reference[name]


def check(name, precision, fuse, checkpoint, head, compile=False):
    engine, losses, build, stock_keys = run(name, precision=precision, fuse=fuse, checkpoint=checkpoint,
                                            keep_fp32_head=head, compile=compile)
    ref = reference(name)
    assert abs(losses[-1] - ref[-1]) <= LOSS_TOLERANCE[precision] * ref[-1], (losses, ref, engine.describe())
    plan = engine.plan
    assert plan.norm_params, "no norm found"
    assert all(p.dtype == torch.float32 for p in plan.norm_params if p in set(engine.module.parameters()))
    if head:
        assert plan.head is not None and all(p.dtype == torch.float32 for p in plan.head.parameters())
    state = engine.state_dict()["model"]
    assert set(state) == stock_keys and all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    build().load_state_dict(state)  # strict: the stock layout


GRID = list(itertools.product(PRECISIONS, ((), True), (None, "blocks", "selective"), (False, True)))
#: A covering array of GRID: every pair of values of any two axes appears in some row (9 of 36).
PAIRWISE = [
    ("bf16-master", (), None, False), ("bf16-master", True, "blocks", True),
    ("bf16-master", True, "selective", False), ("bf16-mixed", True, None, True),
    ("bf16-mixed", (), "blocks", False), ("bf16-mixed", (), "selective", True),
    ("fp16-master", True, None, False), ("fp16-master", (), "blocks", True),
    ("fp16-master", True, "selective", True),
]


def test_pairwise_rows_cover_every_pair_of_the_grid():
    for i, j in itertools.combinations(range(4), 2):
        want = {(row[i], row[j]) for row in GRID}
        assert want == {(row[i], row[j]) for row in PAIRWISE}, (i, j)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("precision, fuse, checkpoint, head", PAIRWISE)
def test_eager_combinations(name, precision, fuse, checkpoint, head):
    check(name, precision, fuse, checkpoint, head)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("precision, fuse, checkpoint, head", [r for r in GRID if r not in PAIRWISE])
def test_eager_combinations_full_grid(name, precision, fuse, checkpoint, head):
    check(name, precision, fuse, checkpoint, head)


#: Compiled combinations: each precision, fusion on and off, both checkpoint modes, both head modes.
COMPILED = [("bf16-master", True, "blocks", True), ("fp16-master", (), "selective", False),
            ("bf16-mixed", True, None, False)]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("precision, fuse, checkpoint, head", COMPILED[:1])
def test_compiled_combination(name, precision, fuse, checkpoint, head):
    torch._dynamo.reset()
    check(name, precision, fuse, checkpoint, head, compile=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("precision, fuse, checkpoint, head", COMPILED[1:])
def test_compiled_combinations_slow(name, precision, fuse, checkpoint, head):
    torch._dynamo.reset()
    check(name, precision, fuse, checkpoint, head, compile=True)
