"""Sequence bucketing bounds torch.compile's graphs; padding leaves a causal LM's loss unchanged."""

import warnings

import pytest
import torch
from torch import nn

from turbotrain.batch import Batch, pad_to_bucket
from turbotrain.errors import ConfigError
from turbotrain.fusion import bucket_length, check_recompile_budget, fuse, recompile_count, recompile_limit
from turbotrain.fusion import compile as fcompile
from turbotrain.workloads.base import cross_entropy_loss


def pad_batch(batch, buckets, model):
    padded = pad_to_bucket(Batch((batch[0],), {}, batch[1]), buckets, model)
    return padded.args[0], padded.targets


class CausalLM(nn.Module):
    """Tiny causal model: a running mean over positions only ever looks left."""

    is_causal = True

    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        steps = torch.arange(1, idx.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return self.lm_head(self.mlp(x.cumsum(1) / steps))


def test_bucket_length_picks_the_smallest_fitting_bucket():
    assert bucket_length(1, (8, 16)) == 8
    assert bucket_length(8, (16, 8)) == 8
    assert bucket_length(9, (8, 16)) == 16
    with pytest.raises(ConfigError, match="seq_bucket"):
        bucket_length(17, (8, 16))


def test_pad_batch_keeps_the_mean_loss_of_a_causal_lm():
    torch.manual_seed(0)
    model = CausalLM()
    idx, targets = torch.randint(0, 50, (3, 11)), torch.randint(0, 50, (3, 11))
    targets[1, -2:] = -100
    padded = pad_batch((idx, targets), (8, 16), model)
    assert padded[0].shape == (3, 16) and (padded[0][:, 11:] == 0).all() and (padded[1][:, 11:] == -100).all()
    torch.testing.assert_close(cross_entropy_loss(model(padded[0]), padded[1]),
                               cross_entropy_loss(model(idx), targets))
    same = pad_batch((idx[:, :8], targets[:, :8]), (8, 16), model)
    assert same[0].shape == (3, 8)  # already a bucket length: untouched
    labels = torch.zeros(3, dtype=torch.long)
    assert pad_batch((idx, labels), (16,), model)[1] is labels  # per-sample labels have no length


def test_buckets_bound_the_number_of_compiles():
    torch._dynamo.reset()
    model = CausalLM()
    fuse(model)  # fused modules compile too, and their own epilogues are not counted as recompiles
    compiled = torch.compile(model)
    buckets = (8, 16)
    before = recompile_count()
    per_compile = None
    for length in (3, 5, 8, 9, 12, 16, 7):
        idx = torch.randint(0, 50, (2, length))
        idx, targets = pad_batch((idx, idx), buckets, model)
        cross_entropy_loss(compiled(idx), targets).backward()
        if per_compile is None:  # graph breaks around the fused ops: one compile may be several graphs
            per_compile = recompile_count() - before
    assert per_compile >= 1
    assert recompile_count() - before <= per_compile * len(buckets)


def test_recompile_budget_warns_once(monkeypatch):
    monkeypatch.setattr(fcompile, "_WARNED", [False])
    limit = recompile_limit()
    assert not check_recompile_budget(count=0)
    with pytest.warns(UserWarning, match="seq_buckets"):
        assert check_recompile_budget(count=limit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not check_recompile_budget(count=limit + 5)


def _with_a_graph_break(x):
    y = x.sin()
    if bool((y > 0).all()):  # data-dependent: Dynamo splits the function into two graphs here
        y = y + 1
    return y.cos()


def _with_another_graph_break(x):
    y = x.cos()
    if bool((y < 2).all()):
        y = y * 2
    return y.sin()


def _per_shape(x):
    return x.sin().cos()


def test_recompile_budget_counts_graphs_per_function_and_names_the_one_near_the_limit(monkeypatch):
    # A model with graph breaks holds several functions of one graph each: not a reason to warn
    # (the process count did warn here, with advice about sequence lengths that did not apply).
    torch._dynamo.reset()
    monkeypatch.setattr(fcompile, "_WARNED", [False])
    with torch._dynamo.config.patch(recompile_limit=4):
        _near_the_limit_only_per_function()
    torch._dynamo.reset()


def _near_the_limit_only_per_function():
    for f in (_with_a_graph_break, _with_another_graph_break):  # two functions and their resumes, a graph each
        torch.compile(f, dynamic=False)(torch.randn(4))
    assert recompile_count() >= 0.75 * 4  # what the warning counted before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not check_recompile_budget()
    compiled = torch.compile(_per_shape, dynamic=False)
    for n in (3, 5, 7):  # one graph per shape, all for one function
        compiled(torch.randn(n))
    with pytest.warns(UserWarning, match=r"3 graphs compiled for _per_shape \(.*test_fusion_compile.py:\d+\)"):
        assert check_recompile_budget()


def test_repeated_low_precision_reductions_become_copies_of_the_first():
    from torch.fx.experimental.proxy_tensor import make_fx

    def grads(g):  # two biases fed by one residual: each gradient is the same column sum
        return g.sum(0), g.sum(0), g.float().sum(0), g.amax(0)

    gm = make_fx(grads)(torch.randn(6, 4, dtype=torch.bfloat16))
    sums = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]
    assert len(sums) == 3  # the FP32 sum is not the same reduction
    assert fcompile.fold_repeated_reductions(gm.graph) == 1
    gm.recompile()
    assert len([n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]) == 2
    assert len([n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]) == 1
    g = torch.randn(6, 4, dtype=torch.bfloat16)
    first, second, wide, peak = gm(g)
    torch.testing.assert_close(second, g.sum(0), rtol=0, atol=0)
    assert second.data_ptr() != first.data_ptr()  # its own buffer: the two gradients do not alias
    torch.testing.assert_close(wide, g.float().sum(0))
    torch.testing.assert_close(peak, g.amax(0))


class ParallelResidual(nn.Module):
    """``x + attn(x) + mlp(x)`` as GPT-NeoX and Phi write it: both output biases get one gradient."""

    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn_out, self.mlp_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        return self.lm_head(x + self.attn_out(x) + self.mlp_out(torch.relu(x)))


def test_compile_trains_a_parallel_residual_in_bf16():
    """bf16 parameters make the repeated bias-gradient sum bf16, which Inductor (torch 2.13, CPU)
    compiled into a kernel that did not build (fold_repeated_reductions); the Engine's compile trains
    it, as eager bf16 does."""
    from turbotrain import Config, Engine

    torch._dynamo.reset()
    idx = torch.randint(0, 40, (4, 12), generator=torch.Generator().manual_seed(0))
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = ParallelResidual()
        engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss,
                        config=Config(device="cpu", precision="bf16-master", compile=compiled))
        losses[compiled] = [float(engine.step((idx, idx)).loss) for _ in range(3)]
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-2, atol=0)


def test_each_kind_of_engine_gets_its_own_recompile_limit_and_a_rebuilt_one_reuses_its_graphs(monkeypatch):
    # Every Engine's runner was one function, so Dynamo's per-function limit was spent across Engines:
    # after `limit` models of different widths the next ran eagerly under compile=True.
    from torch._dynamo.utils import counters

    from turbotrain import Config, Engine

    monkeypatch.setattr(fcompile, "_WARNED", [True])  # the budget warning is another test's subject
    torch._dynamo.reset()

    def steps(dim):
        torch.manual_seed(0)
        model = CausalLM(dim=dim)
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss,
                        config=Config(device="cpu", precision="fp32", compile=True))
        before = counters["stats"]["unique_graphs"]
        idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
        engine.step((idx, idx))
        return counters["stats"]["unique_graphs"] - before

    with torch._dynamo.config.patch(recompile_limit=2):
        assert [steps(dim) for dim in (8, 16, 24)] == [1, 1, 1]  # the third compiled too
        assert steps(8) == 0  # the same model again: the first Engine's graph serves it
    torch._dynamo.reset()


class OwnLossLM(nn.Module):
    """A model that builds its loss modules in forward, as Hugging Face's BART and T5 do
    (``loss_fct = CrossEntropyLoss()``), or keeps one from __init__."""

    def __init__(self, built_in_forward):
        super().__init__()
        self.built_in_forward = built_in_forward
        self.emb, self.head = nn.Embedding(512, 64), nn.Linear(64, 512)
        with torch.no_grad():
            self.head.weight.mul_(20)  # sharp logits: a bf16 loss is visibly rounded
        self.crit = nn.CrossEntropyLoss()

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.emb(ids)))
        flat, flat_labels = logits.view(-1, 512), labels.view(-1)
        if self.built_in_forward:
            loss = nn.CrossEntropyLoss()(flat, flat_labels) + 0.0 * nn.Softmax(-1)(flat).amax()
        else:
            loss = self.crit(flat, flat_labels)
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("built_in_forward", [True, False])
def test_the_compiled_step_keeps_a_loss_module_built_in_forward_in_fp32(built_in_forward):
    # Dynamo does not hand the keep-list mode the call of a torch.nn module constructed inside the
    # compiled code; Inductor then computed the cross-entropy in bf16 (22.125 for 22.0875 here; BART's
    # losses 2e-3 off). The pre-grad pass gives such calls FP32 inputs as the mode would.
    from turbotrain import Config, Engine

    g = torch.Generator().manual_seed(0)
    batch = {"ids": torch.randint(0, 512, (4, 64), generator=g), "labels": torch.randint(0, 512, (4, 64), generator=g)}
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        engine = Engine(OwnLossLM(built_in_forward), lambda p: torch.optim.SGD(p, lr=0.0),
                        config=Config(device="cpu", precision="bf16-master", compile=compiled))
        losses.append(float(engine.step(batch).loss))
    eager, compiled = losses
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert compiled != float(torch.tensor(compiled).bfloat16())  # not a bf16 value


def test_the_keep_list_pass_leaves_ops_the_mode_handled_and_fp32_runs_alone():
    from turbotrain.precision.keep_fp32 import KeepFp32Mode

    counts = []

    def backend(gm, example_inputs):
        counts.append(fcompile.keep_fp32_in_graph(gm.graph))
        gm.recompile()
        return gm

    x, y = torch.randn(8, 16).bfloat16(), torch.randint(0, 16, (8,))
    for fn, mode in ((lambda x, y: nn.CrossEntropyLoss()(x, y), KeepFp32Mode(match_operands=True)),
                     (lambda x, y: torch.nn.functional.cross_entropy(x, y), KeepFp32Mode(match_operands=True)),
                     (lambda x, y: nn.CrossEntropyLoss()(x.float(), y), None)):
        torch._dynamo.reset()
        with mode if mode is not None else torch.no_grad():
            out = torch.compile(fn, backend=backend)(x, y)
        assert out.dtype == torch.float32
    assert counts == [1, 0, 0]  # the module built in the code; the call the mode saw; FP32 inputs
