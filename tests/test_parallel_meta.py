"""Building on the meta device, in one process: the recorded init against the eager build, and the refusals.

The sharded runs (2 gloo ranks: the Engine shards a meta gpt and an HF Llama, the memory it allocates)
are in tests/test_parallel_dist.py. Here the recorded init is replayed into a plain, unsharded model,
which needs no process group, and compared with the model built eagerly from the same seed: the oracle
is torch building the model itself.
"""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn

from turbotrain import Config, Engine, MetaInitError
from turbotrain.parallel import ParallelConfig, hf_init_weights, record_init, reset_parameters
from turbotrain.workloads import get_workload
from turbotrain.workloads.gpt import GPT as Model, GPTSettings

GPT = dict(d=32, n_layer=2, n_head=2, T=16, B=2, vocab_size=512)
SHARDED = Config(parallel=ParallelConfig(), device="cpu")


def gpt_init(model):
    """docs/parallel.md's recipe for gpt."""
    reset_parameters(model)
    model._init_weights(len(model.blocks))


def replayed(model: nn.Module, init_weights=None) -> nn.Module:
    """``model`` (on meta) with its recorded init replayed into plain CPU tensors: what each rank computes
    before taking its shard."""
    tape = record_init(model, init_weights)
    tape.materialise(model, torch.device("cpu"))
    return model


def state(model: nn.Module) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def assert_same(got: nn.Module, want: nn.Module) -> None:
    got, want = state(got), state(want)
    assert got.keys() == want.keys()
    for name in want:
        assert not got[name].is_meta, name
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


class Scaled(nn.Module):
    """A Linear and values its __init__ sets by hand: lost on the meta device unless an init writes them."""

    def __init__(self, d=4, t=3):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d))
        self.register_buffer("mask", torch.tril(torch.ones(t, t)), persistent=False)


def scaled_init(model):
    reset_parameters(model)
    nn.init.ones_(model.scale)
    model.mask.copy_(torch.tril(torch.ones(3, 3)))


def meta(build):
    with torch.device("meta"):
        return build()


# -- the recorded init is the eager build ---------------------------------------------------------
def test_gpt_recorded_on_meta_is_the_eager_build_and_leaves_the_generator_where_it_would():
    wl = get_workload("gpt", **GPT)
    model = meta(wl.build_model)
    torch.manual_seed(0)
    replayed(model, gpt_init)
    after = torch.rand(4)
    torch.manual_seed(0)  # GPT's own __init__ (seeded_build forks the generator around it)
    eager = Model(GPTSettings(**GPT))
    assert_same(model, eager)
    assert torch.equal(torch.rand(4), after)  # draws made as eagerly: later random numbers are the same


def test_hf_llama_recorded_on_meta_is_the_eager_build_buffers_included():
    pytest.importorskip("transformers")
    from hf_models import build

    model = meta(lambda: build("llama"))
    record_init(model, hf_init_weights)  # takes off the marks Hugging Face leaves: a second call records again
    torch.manual_seed(0)
    replayed(model, hf_init_weights)
    assert_same(model, build("llama"))  # inv_freq and original_inv_freq (non-persistent) too


def test_hf_llama_with_torchs_resets_alone_names_what_stays_uninitialised():
    pytest.importorskip("transformers")
    from hf_models import build

    model = meta(lambda: build("llama"))
    with pytest.raises(MetaInitError, match=r"uninitialised: parameter model.layers.0.input_layernorm.weight") as err:
        record_init(model)
    assert "buffer model.rotary_emb.inv_freq" in str(err.value) or "more" in str(err.value)
    assert "init_weights=fn" in str(err.value)


def test_an_init_writing_views_and_buffers_in_place_is_replayed():
    torch.manual_seed(3)
    eager = Scaled()
    model = meta(Scaled)
    torch.manual_seed(3)
    assert_same(replayed(model, scaled_init), eager)


class Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)
        self.lin = nn.Linear(4, 6)
        self.conv = nn.Conv1d(3, 3, 3)
        self.norm = nn.LayerNorm(6)
        self.square = nn.Linear(5, 5, bias=False)
        self.wide = nn.Linear(7, 3, bias=False)


def zoo_init(model, generator):
    """torch.nn.init's shortcuts for meta tensors (trunc_normal_, orthogonal_, dirac_, sparse_ return at once on
    one) must not skip the stand-ins; orthogonal_ draws into a scratch tensor and copies its QR in, and
    trunc_normal_ redraws until its values fall inside its bounds."""
    nn.init.trunc_normal_(model.lin.weight, std=0.02)
    nn.init.trunc_normal_(model.conv.bias, std=1.0, a=-0.1, b=0.1)  # narrow: torch's other sampler
    nn.init.orthogonal_(model.wide.weight)
    nn.init.dirac_(model.conv.weight)
    nn.init.sparse_(model.square.weight, 0.5)
    nn.init.kaiming_normal_(model.emb.weight, generator=generator)  # the user's own generator
    model.emb.weight[0].zero_()


def test_torchs_init_functions_on_meta_are_the_eager_ones():
    torch.manual_seed(5)
    eager = Zoo()
    with torch.no_grad():
        zoo_init(eager, torch.Generator().manual_seed(7))
    model = meta(Zoo)
    torch.manual_seed(5)  # Zoo() reset its modules, then zoo_init ran
    assert_same(replayed(model, lambda m: (reset_parameters(m), zoo_init(m, torch.Generator().manual_seed(7)))),
                eager)


class Halves(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 3))  # no reset_parameters: only the two halves write it


def halves(model):
    model.weight[:2].normal_()
    model.weight[2:].zero_()


def test_rows_written_apart_cover_the_parameter():
    torch.manual_seed(1)
    eager = Halves()
    with torch.no_grad():
        halves(eager)
    model = meta(Halves)
    torch.manual_seed(1)
    assert_same(replayed(model, halves), eager)


def test_a_real_buffer_assigned_by_the_init_is_kept():
    def init(model):
        reset_parameters(model)
        nn.init.ones_(model.scale)
        model.register_buffer("mask", torch.tril(torch.ones(3, 3)), persistent=False)

    model = replayed(meta(Scaled), init)
    assert torch.equal(model.mask, torch.tril(torch.ones(3, 3)))


def test_doctests():
    from turbotrain.parallel import meta_init

    assert doctest.testmod(meta_init).failed == 0


# -- refusals: each a MetaInitError (a ConfigError) naming the problem and the fix, no process group --
def test_a_meta_model_without_parallel_is_refused():
    with pytest.raises(MetaInitError, match=r"Config\(parallel=ParallelConfig") as err:
        Engine(meta(lambda: nn.Linear(4, 2)), lambda p: torch.optim.SGD(p, lr=0.1), config=Config(device="cpu"))
    assert "build the model on a device" in str(err.value)


@pytest.mark.parametrize("degrees, named", [(dict(tp=2), "tp=2"), (dict(cp=2), "cp=2")])
def test_tensor_and_context_parallel_with_a_meta_model_are_refused(degrees, named):
    config = Config(parallel=ParallelConfig(**degrees), device="cpu")
    with pytest.raises(MetaInitError, match=f"not supported yet.*set {named[:2]}=1"):
        Engine(meta(lambda: nn.Linear(4, 2)), lambda p: torch.optim.SGD(p, lr=0.1), config=config)


@pytest.mark.parametrize("setting, named", [(dict(fuse=("qkv",)), "fuse"), (dict(keep_fp32_head=True),
                                                                           "keep_fp32_head")])
def test_settings_that_need_real_weights_before_sharding_are_refused(setting, named):
    config = Config(parallel=ParallelConfig(), device="cpu", **setting)
    with pytest.raises(MetaInitError, match=named):
        Engine(meta(lambda: nn.Linear(4, 2)), lambda p: torch.optim.SGD(p, lr=0.1), config=config)


def test_a_parameter_left_uninitialised_is_named():
    with pytest.raises(MetaInitError, match=r"parameter scale \(4,\), buffer mask \(3, 3\)") as err:
        Engine(meta(Scaled), lambda p: torch.optim.SGD(p, lr=0.1), config=SHARDED)
    assert "no init_weights was given" in str(err.value) and "reset_parameters(model)" in str(err.value)
    with pytest.raises(MetaInitError, match=r"uninitialised: buffer mask .*init_weights did not write them"):
        Engine(meta(Scaled), lambda p: torch.optim.SGD(p, lr=0.1), config=SHARDED,
               init_weights=lambda m: (reset_parameters(m), nn.init.ones_(m.scale)))


def test_half_a_parameter_written_is_uninitialised():
    with pytest.raises(MetaInitError, match=r"parameter weight \(3, 4\)"):
        record_init(meta(lambda: nn.Linear(4, 3)), lambda m: (m.weight[:2].normal_(), m.bias.zero_()))


def test_init_weights_for_a_model_with_real_weights_is_refused():
    with pytest.raises(MetaInitError, match="weights are real already"):
        Engine(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), config=Config(device="cpu"),
               init_weights=reset_parameters)


@pytest.mark.parametrize("init, named", [
    (lambda m: (reset_parameters(m), m.bias.copy_(m.weight[0])), r"writes parameter bias from parameter weight"),
    (lambda m: (m.weight * 2).normal_(), r"draws random numbers into a tensor computed from the model's"),
    (lambda m: (reset_parameters(m), m.bias.zero_() if m.weight.sum() > 0 else None),
     r"needs the values of a tensor of the model.*reads values back"),
])
def test_inits_that_read_other_tensors_or_values_are_refused(init, named):
    with pytest.raises(MetaInitError, match=named):
        record_init(meta(lambda: nn.Linear(3, 3)), init)


def test_a_refusal_the_init_catches_is_raised_all_the_same():
    def swallow(model):
        try:
            model.bias.copy_(model.weight[0])
        except Exception:
            pass
        reset_parameters(model)

    with pytest.raises(MetaInitError, match="writes parameter bias from parameter weight"):
        record_init(meta(lambda: nn.Linear(3, 3)), swallow)


def test_a_parameter_replaced_by_a_real_one_is_refused():
    def replace(model):
        model.weight = nn.Parameter(torch.zeros(2, 4))

    with pytest.raises(MetaInitError, match="replaced the meta parameter weight"):
        record_init(meta(lambda: nn.Linear(4, 2)), replace)


def test_a_model_partly_on_meta_is_refused():
    model = nn.Sequential(nn.Linear(2, 2), meta(lambda: nn.Linear(2, 2)))
    with pytest.raises(MetaInitError, match=r"on the meta device and 2 on cpu \(0.weight the first\)"):
        record_init(model)
