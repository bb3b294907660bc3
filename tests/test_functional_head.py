"""The fused linear+cross-entropy on a head the model writes as ``F.linear(h, W)`` on a Parameter no
Linear holds (a tied embedding written out, as OLMo's code does): found by data flow, checked against
the stock loss, and reached through a function mode while the Engine's forward runs; the model and
its state_dict stay as the user built them."""

import pytest
import torch
from torch import nn

from turbotrain import Config, Engine
from turbotrain.fusion.loss_head import FusedLossHead

F = nn.functional
VOCAB, D = 40, 16


class FunctionalGPT(nn.Module):
    def __init__(self, what="loss_fn"):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        nn.init.normal_(self.emb.weight, std=0.3)
        self.mix = nn.Linear(D, D)
        self.out_bias = nn.Parameter(torch.zeros(VOCAB)) if what == "bias" else None
        self.what = what

    def forward(self, idx, targets=None):
        x = torch.tanh(self.mix(self.emb(idx)))
        if self.what == "matmul":  # Gemma's reference code
            logits = torch.matmul(x, self.emb.weight.t())
        elif self.what == "T":
            logits = x @ self.emb.weight.T
        elif self.what == "einsum":  # einops-minded code
            logits = torch.einsum("b n d, c d -> b n c", x, self.emb.weight)
        elif self.what == "ellipsis":
            logits = torch.einsum("...d,cd->...c", x, self.emb.weight)
        else:
            logits = F.linear(x, self.emb.weight, self.out_bias)
        if self.what != "own":
            return logits
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-1)
        return logits, loss


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-1)


def capped_loss(logits, targets):
    return lm_loss(3.0 * torch.tanh(logits / 3.0), targets)


def batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (4, 13), generator=g)
        targets = ids[:, 1:].clone()
        targets[:, -3:] = -1
        out.append((ids[:, :-1].contiguous(), targets))
    return out


def train(what, fuse, precision="fp32", compile=False):
    torch.manual_seed(0)
    model = FunctionalGPT(what)
    loss_fn = None if what == "own" else capped_loss if what == "softcap" else lm_loss
    engine = Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-2), loss_fn,
                    config=Config(device="cpu", precision=precision, fuse=fuse, compile=compile))
    stats = [engine.step(b) for b in batches()]
    engine.last_stats = stats[-1]
    return engine, [float(s.loss) for s in stats]


@pytest.mark.parametrize("what", ["loss_fn", "own", "bias", "matmul", "T", "einsum", "ellipsis"])
def test_a_functional_tied_head_is_fused_and_trains_as_the_stock_run(what):
    engine, fused = train(what, ("linear_cross_entropy",))
    head = engine._transform("fusion").loss_head
    assert head.fused, head.reason
    assert head.path == "emb.weight (F.linear)"
    assert isinstance(engine.plan.loss_head, FusedLossHead)
    assert not any(isinstance(m, FusedLossHead) for m in engine.module.modules())  # nothing swapped in
    assert set(engine.module.state_dict()) == set(FunctionalGPT(what).state_dict())
    _, stock = train(what, False)
    assert fused == pytest.approx(stock, rel=1e-5)


@pytest.mark.parametrize("equation, linear", [
    ("btd,vd->btv", True), ("b t d, v d -> b t v", True), ("bd,vd->bv", True),
    ("btd,dv->btv", False), ("btd,vd->bvt", False), ("btd,ve->btv", False), ("...d,vd->...v", True),
    ("...d,vd->v...", False), ("...d,vd->bv", False), ("b...d,vd->b...v", False), ("...d,dv->...v", False),
    ("...,vd->...v", False)])
def test_einsum_reads_as_a_linear_only_for_x_times_w_transposed(equation, linear):
    from turbotrain.fusion.loss_head import einsum_as_linear

    x, w = torch.zeros(2, 3, 4), torch.zeros(5, 4)
    assert (einsum_as_linear((equation, x, w)) is not None) == linear


def test_outside_the_training_step_the_model_computes_its_logits():
    engine, _ = train("loss_fn", ("linear_cross_entropy",))
    idx, targets = batches(1, seed=3)[0]
    with torch.no_grad():
        logits = engine.module(idx)
        x = torch.tanh(engine.module.mix(engine.module.emb(idx)))
        assert torch.allclose(logits, x @ engine.module.emb.weight.T, atol=1e-6)
        assert engine.eval_loss([(idx, targets)]) == pytest.approx(float(lm_loss(logits, targets)), rel=1e-6)


def test_a_soft_capped_loss_on_a_functional_head_leaves_it_unfused_with_the_reason():
    engine, losses = train("softcap", ("linear_cross_entropy",))
    head = engine._transform("fusion").loss_head
    assert not head.fused and "pass through" in head.reason, head.reason
    assert engine.plan.loss_head is None
    _, stock = train("softcap", False)
    assert losses == pytest.approx(stock, rel=1e-6)


@pytest.mark.parametrize("what", ["loss_fn", "matmul", "T", "einsum"])
def test_the_functional_fused_head_compiles_without_recompiles(what):
    torch._dynamo.reset()
    engine, fused = train(what, ("linear_cross_entropy",), compile=True)
    assert engine._transform("fusion").loss_head.fused
    assert engine.last_stats.recompiles == 0
    _, stock = train(what, False)
    assert fused == pytest.approx(stock, rel=1e-4)


def test_the_functional_fused_head_in_bf16_master_follows_the_unfused_run():
    engine, fused = train("own", ("linear_cross_entropy",), precision="bf16-master")
    assert engine._transform("fusion").loss_head.fused
    _, stock = train("own", False, precision="bf16-master")
    assert fused == pytest.approx(stock, rel=2e-2)
    assert fused[-1] < fused[0]


@pytest.mark.parametrize("loss_fn, why", [(lm_loss, ""), (capped_loss, "pass through")])
def test_profile_and_tune_see_the_functional_head(loss_fn, why):
    from turbotrain.batch import LossContract, as_batch
    from turbotrain.fusion.loss_head import loss_head_refusal
    from turbotrain.tune.facts import analyse

    torch.manual_seed(0)
    model, batch = FunctionalGPT(), batches(1)[0]
    refusal = loss_head_refusal(model, None, LossContract(loss_fn), as_batch(batch, torch.device("cpu"), True))
    assert (why in refusal) if why else refusal == ""
    facts = analyse(FunctionalGPT, loss_fn, batch)
    assert facts.sites["linear_cross_entropy"] == 1
    assert facts.logits_bytes == 4 * 12 * VOCAB * 4  # rows x positions x vocabulary, FP32


@pytest.mark.parametrize("fuse", [False, ("linear_cross_entropy",)])
@pytest.mark.parametrize("what", ["loss_fn", "matmul", "einsum"])
def test_keep_fp32_head_keeps_a_functional_head_fp32(what, fuse):
    """keep_fp32_head on a tied head written as F.linear, a matmul or an einsum: the tied weight stays
    FP32 (as it does for an nn.Linear head tied to the embedding) and the head's input is cast to FP32,
    so the logits are computed in FP32 (it warned that no head was found)."""
    import warnings

    torch.manual_seed(0)
    model = FunctionalGPT(what)
    engine = Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-2), lm_loss,
                    config=Config(device="cpu", precision="bf16-master", fuse=fuse, keep_fp32_head=True))
    data = batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.step(data[0])
    assert not [w for w in caught if "keep_fp32_head" in str(w.message)]  # no "no head is kept in FP32"
    head = engine.plan.head
    assert head is not None and engine.plan.head_params() == [model.emb.weight]
    assert model.emb.weight.dtype == torch.float32 and model.mix.weight.dtype == torch.bfloat16
    seen = []
    head.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(args[0].dtype), with_kwargs=True,
                                   prepend=False)
    losses = [float(engine.step(b).loss) for b in data[1:]]
    assert seen == [torch.float32] * len(data[1:])
    assert isinstance(head, FusedLossHead) == bool(fuse)
    # close to the FP32 run's, and no further than the bf16-master run without the FP32 head
    _, fp32 = train(what, False)
    _, bf16 = train(what, False, precision="bf16-master")
    assert max(abs(a - b) for a, b in zip(losses, fp32[1:])) <= max(abs(a - b) for a, b in zip(bf16[1:], fp32[1:])) + 1e-3


def test_keep_fp32_head_on_a_model_with_no_head_says_so_once():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh())  # no Linear's output returned
    engine = Engine(model, lambda p: torch.optim.SGD(p, lr=0.1), lambda out, y: (out - y).pow(2).mean(),
                    config=Config(device="cpu", precision="bf16-master", keep_fp32_head=True))
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="no head is kept in FP32"):
        engine.step((x, torch.tanh(x)))
    assert engine.plan.head is None


class CastedLinear(nn.Linear):
    """modded-nanogpt's head: a Linear whose forward casts the weight to the input's dtype."""

    def forward(self, x):
        return F.linear(x, self.weight.type_as(x))


class ScaledReadout(nn.Linear):
    """muP's readout: the input scaled by a width multiplier before the Linear."""

    def forward(self, x):
        return super().forward(x * 0.5)


class InitLinear(nn.Linear):
    """A Linear subclass for its initialisation only (nn.Linear's forward)."""

    def reset_parameters(self):
        nn.init.normal_(self.weight, std=0.3)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class SubclassHeadGPT(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.emb, self.mix = nn.Embedding(VOCAB, D), nn.Linear(D, D)
        self.lm_head = head

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.mix(self.emb(idx))))


SUBCLASS_HEADS = {
    "casted": lambda: CastedLinear(D, VOCAB, bias=False),
    "scaled-readout": lambda: ScaledReadout(D, VOCAB),
    "init-only": lambda: InitLinear(D, VOCAB),
    "weight-norm": lambda: nn.utils.parametrizations.weight_norm(nn.Linear(D, VOCAB)),
}


def train_subclass(what, fuse, precision="fp32"):
    torch.manual_seed(0)
    model = SubclassHeadGPT(SUBCLASS_HEADS[what]())
    engine = Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-2), lm_loss,
                    config=Config(device="cpu", precision=precision, fuse=fuse))
    return engine, [float(engine.step(b).loss) for b in batches()]


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
@pytest.mark.parametrize("what, path", [("casted", "lm_head.weight (F.linear)"),
                                        ("scaled-readout", "lm_head.weight (F.linear)"), ("init-only", "lm_head")])
def test_a_head_that_subclasses_linear_is_fused_with_what_its_forward_does(what, path, precision):
    # A subclass with its own forward keeps it (the input scale, the cast): its F.linear call on its
    # own weight is answered; one with nn.Linear's forward is swapped like a Linear. Each was refused
    # before ("the head is a CastedLinear, not an nn.Linear").
    engine, fused = train_subclass(what, ("linear_cross_entropy",), precision)
    head = engine._transform("fusion").loss_head
    assert head.fused and head.path == path, head.reason
    assert isinstance(engine.plan.loss_head, FusedLossHead)
    assert type(engine.module.lm_head) is (FusedLossHead if what == "init-only" else SUBCLASS_HEADS[what]().__class__)
    _, stock = train_subclass(what, False, precision)
    assert fused == pytest.approx(stock, rel=1e-5 if precision == "fp32" else 5e-3)
    if what == "scaled-readout":  # the fused kernel skipping the scale would be a different loss
        assert fused[1:] != pytest.approx(train_subclass("init-only", False, precision)[1][1:], rel=1e-2)


def test_a_casted_head_under_autocast_stays_unfused_and_says_why():
    # Under autocast the input is bf16 and the weight FP32, so CastedLinear's cast makes a new tensor:
    # no call on the weight itself to answer. It once read "no Linear produces the logits".
    engine, fused = train_subclass("casted", ("linear_cross_entropy",), "bf16-mixed")
    head = engine._transform("fusion").loss_head
    assert not head.fused and head.path == "lm_head", head.reason
    assert "CastedLinear whose own forward does not call F.linear on its weight as it is" in head.reason
    assert fused == pytest.approx(train_subclass("casted", False, "bf16-mixed")[1], rel=1e-6)


@pytest.mark.parametrize("keep", [False, True])
def test_a_casted_head_is_fused_under_compile_and_with_keep_fp32_head(keep):
    # keep_fp32_head hands the subclass's forward FP32 inputs (its hook stays on the subclass), so its
    # cast leaves the FP32 weight the call is answered on; on the fused head the cast made a bf16 copy
    # and the armed head was never called.
    def run(fuse):
        torch.manual_seed(0)
        model = SubclassHeadGPT(SUBCLASS_HEADS["casted"]())
        engine = Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-2), lm_loss,
                        config=Config(device="cpu", precision="bf16-master", fuse=fuse, compile=not keep,
                                      keep_fp32_head=keep))
        stats = [engine.step(b) for b in batches()]
        return engine, [float(s.loss) for s in stats], stats[-1]

    engine, fused, last = run(("linear_cross_entropy",))
    assert engine._transform("fusion").loss_head.fused
    assert engine.module.lm_head.weight.dtype == (torch.float32 if keep else torch.bfloat16)
    assert last.recompiles == 0
    assert fused == pytest.approx(run(False)[1], rel=1e-4)


def test_a_parametrized_head_stays_unfused_and_says_why():
    engine, fused = train_subclass("weight-norm", ("linear_cross_entropy",))
    head = engine._transform("fusion").loss_head
    assert not head.fused and "computed by a parametrization (weight)" in head.reason, head.reason
    assert fused == pytest.approx(train_subclass("weight-norm", False)[1], rel=1e-6)
