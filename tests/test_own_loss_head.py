"""The fused linear+cross-entropy on a model that computes its own loss from the targets it is given
(nanoGPT's ``forward(idx, targets)``): its ``F.cross_entropy`` on the head's logits becomes the fused
loss, with the call's own ignore_index and reduction, and what the model adds to it stays."""

import pytest
import torch
from torch import nn

from turbotrain import Config, Engine
from turbotrain.fusion.loss_head import FusedLossHead

F = nn.functional
VOCAB, D = 40, 16


class TinyGPT(nn.Module):
    """nanoGPT's shape: tied embedding and head, forward(idx, targets) -> (logits, loss)."""

    def __init__(self, what="plain"):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.mix = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.emb.weight = self.lm_head.weight
        self.what = what
        self.criterion = nn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, idx, targets=None):
        x = torch.tanh(self.mix(self.emb(idx)))
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        flat, flat_targets = logits.view(-1, logits.size(-1)), targets.view(-1)
        if self.what == "module":
            loss = self.criterion(flat, flat_targets)
        elif self.what == "sum":
            loss = F.cross_entropy(flat, flat_targets, ignore_index=-1, reduction="sum") / 100.0
        elif self.what == "smoothing":
            loss = F.cross_entropy(flat, flat_targets, ignore_index=-1, label_smoothing=0.1)
        elif self.what == "slice":
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets[:, :-1].reshape(-1), ignore_index=-1)
        elif self.what == "twice":
            loss = (F.cross_entropy(flat, flat_targets, ignore_index=-1)
                    + F.cross_entropy(flat, flat_targets, ignore_index=-1))
        elif self.what == "aux":
            loss = F.cross_entropy(flat, flat_targets, ignore_index=-1) + 0.1 * x.pow(2).mean()
        else:
            loss = F.cross_entropy(flat, flat_targets, ignore_index=-1)
        return logits, loss


def batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (4, 13), generator=g)
        targets = ids[:, 1:].clone()
        targets[:, -3:] = -1  # padding the model's own loss ignores (nanoGPT's convention, not -100)
        out.append((ids[:, :-1].contiguous(), targets))
    return out


def train(what, fuse, compile=False):
    torch.manual_seed(0)
    model = TinyGPT(what)
    engine = Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-2),
                    config=Config(device="cpu", precision="fp32", fuse=fuse, compile=compile))
    stats = [engine.step(b) for b in batches()]
    engine.last_stats = stats[-1]
    return engine, [float(s.loss) for s in stats]


@pytest.mark.parametrize("what", ["plain", "module", "sum", "aux", "twice", "smoothing"])
def test_the_models_own_cross_entropy_is_fused_with_its_ignore_index_and_reduction(what):
    engine, fused = train(what, ("linear_cross_entropy",))
    head = engine._transform("fusion").loss_head
    assert head.fused, head.reason
    assert isinstance(engine.module.lm_head, FusedLossHead)
    assert engine.module.emb.weight is engine.module.lm_head.weight  # the tie holds
    _, stock = train(what, False)
    # -1 targets ignored (not scored as class 39), the sum, the smoothing and the model's extra term kept
    assert fused == pytest.approx(stock, rel=1e-5)


@pytest.mark.parametrize("what, reason", [("slice", "no cross-entropy on the whole")])
def test_a_cross_entropy_the_fused_head_cannot_compute_rolls_it_back_with_the_reason(what, reason):
    engine, losses = train(what, ("linear_cross_entropy",))
    head = engine._transform("fusion").loss_head
    assert not head.fused and reason in head.reason, head.reason
    assert type(engine.module.lm_head) is nn.Linear
    _, stock = train(what, False)
    assert losses == pytest.approx(stock, rel=1e-6)


def test_the_unarmed_head_still_gives_the_model_its_logits():
    engine, _ = train("plain", ("linear_cross_entropy",))
    idx = batches(1, seed=3)[0][0]
    with torch.no_grad():
        logits, loss = engine.module(idx)
        x = torch.tanh(engine.module.mix(engine.module.emb(idx)))[:, [-1], :]
        expected = x @ engine.module.lm_head.weight.T
    assert loss is None and torch.allclose(logits, expected, atol=1e-6)


@pytest.mark.parametrize("what", ["plain", "smoothing"])
def test_the_models_own_fused_loss_compiles_without_recompiles(what):
    torch._dynamo.reset()
    engine, fused = train(what, ("linear_cross_entropy",), compile=True)
    assert engine._transform("fusion").loss_head.fused
    assert engine.last_stats.recompiles == 0
    _, stock = train(what, False)
    assert fused == pytest.approx(stock, rel=1e-4)


class RouterLM(nn.Module):
    """A Hugging Face-shaped model whose loss adds a router's load-balancing term (as Mixtral's does
    with output_router_logits=True): a term the fused head would drop."""

    def __init__(self, aux=0.001):
        super().__init__()
        self.emb, self.router, self.lm_head = nn.Embedding(VOCAB, D), nn.Linear(D, 4), nn.Linear(D, VOCAB)
        self.aux = aux

    def forward(self, input_ids, labels=None):
        x = self.emb(input_ids)
        logits = self.lm_head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            if self.aux:
                loss = loss + self.aux * self.router(x).softmax(-1).pow(2).sum(-1).mean()
        return type("Out", (), {"loss": loss, "logits": logits})()


def router_run(aux, fuse, precision, steps=3):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(2))
    model = RouterLM(aux)
    engine = Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-2),
                    config=Config(device="cpu", precision=precision, fuse=fuse))
    losses = [float(engine.step({"input_ids": ids, "labels": ids}).loss) for _ in range(steps)]
    return engine, model, losses


@pytest.mark.parametrize("aux", [0.001, 0.0])
def test_a_loss_term_that_does_not_come_from_the_logits_stays_in_the_fused_run(aux):
    """In bf16 the term is well inside the loss check's tolerance (2e-2) and leaves the head's gradient
    alone, so only the loss's autograd graph shows it: the head does not compute that loss alone (the
    term would be dropped without a word) but answers the model's own cross-entropy call in it."""
    torch.manual_seed(0)
    start = RouterLM(aux).router.weight.detach().to(torch.bfloat16)
    engine, model, _ = router_run(aux, ("linear_cross_entropy",), "bf16-master")
    head = engine._transform("fusion").loss_head
    assert head.fused, head.reason
    assert head.through_loss == bool(aux)
    # the router's only gradient is the term's: it trains exactly when the term is there
    assert (not torch.equal(model.router.weight, start)) == bool(aux)
    engine, _, fused = router_run(aux, ("linear_cross_entropy",), "fp32")
    _, _, stock = router_run(aux, False, "fp32")
    assert fused == pytest.approx(stock, rel=1e-5)


def lm_loss_as(how):
    def loss_fn(logits, targets):
        flat, flat_targets = logits.reshape(-1, VOCAB), targets.reshape(-1)
        if how == "per-token":  # summed, then divided by the tokens scored: the mean over a gradient-accumulation window
            return F.cross_entropy(flat, flat_targets, ignore_index=-1, reduction="sum") / (flat_targets != -1).sum()
        if how == "scaled":
            return F.cross_entropy(flat, flat_targets, ignore_index=-1) * 0.99
        return F.cross_entropy(flat, flat_targets, ignore_index=-1)
    return loss_fn


@pytest.mark.parametrize("pick", ["last", "mask"])
def test_a_loss_on_a_selection_of_positions_keeps_the_head_unfused_and_says_so(pick):
    """Sequence classification on a causal LM's last position, or a boolean-mask selection: the head
    computes every position, the loss scores some, so the fused loss would be another loss."""
    def loss_fn(logits, targets):
        if pick == "last":
            return F.cross_entropy(logits[:, -1], targets[:, -1].clamp(min=0))
        keep = targets != -1
        return F.cross_entropy(logits[keep], targets[keep])

    def run(fuse):
        torch.manual_seed(0)
        engine = Engine(LogitsGPT(), lambda p: torch.optim.AdamW(p, lr=1e-2), loss_fn,
                        config=Config(device="cpu", precision="fp32", fuse=fuse))
        return engine, [float(engine.step(b).loss) for b in batches()]

    engine, losses = run(("linear_cross_entropy",))
    head = engine._transform("fusion").loss_head
    assert not head.fused and "selection of the logits' positions" in head.reason, head.reason
    assert losses == pytest.approx(run(False)[1], rel=1e-6)


class LogitsGPT(TinyGPT):
    def forward(self, idx):
        return self.lm_head(torch.tanh(self.mix(self.emb(idx))))


@pytest.mark.parametrize("how", ["per-token", "scaled", "plain"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_a_loss_fn_that_scales_its_cross_entropy_keeps_the_scale_in_the_fused_run(how, precision):
    """``sum / tokens`` and ``ce * 0.99``: the head once computed the cross-entropy alone, which rolled
    the first back and, in bf16, dropped the 1% scale of the second inside the check's tolerance."""
    def run(fuse):
        torch.manual_seed(0)
        engine = Engine(LogitsGPT(), lambda p: torch.optim.AdamW(p, lr=1e-2), lm_loss_as(how),
                        config=Config(device="cpu", precision=precision, fuse=fuse))
        return engine, [float(engine.step(b).loss) for b in batches()]

    engine, fused = run(("linear_cross_entropy",))
    head = engine._transform("fusion").loss_head
    assert head.fused, head.reason
    assert head.through_loss == (how != "plain")
    _, stock = run(False)
    assert fused == pytest.approx(stock, rel=1e-5 if precision == "fp32" else 2e-3)


class DtypeBranchLM(nn.Module):
    """A forward that does something else once the model is low precision (a logit scale applied only
    then): the set-up's first check runs before a master-weight mode casts the model, so only the
    second check, on the cast model, can see it."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix, self.lm_head = nn.Embedding(VOCAB, D), nn.Linear(D, D), nn.Linear(D, VOCAB)

    def forward(self, idx):
        logits = self.lm_head(torch.tanh(self.mix(self.emb(idx))))
        return logits * 4.0 if self.lm_head.weight.dtype == torch.bfloat16 else logits


def test_the_fused_head_is_checked_again_on_the_model_as_cast_and_rolled_back_there():
    def run(fuse, model_cls=DtypeBranchLM):
        torch.manual_seed(0)
        engine = Engine(model_cls(), lambda p: torch.optim.AdamW(p, lr=1e-2),
                        lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten(), ignore_index=-1),
                        config=Config(device="cpu", precision="bf16-master", fuse=fuse))
        return engine, [float(engine.step(b).loss) for b in batches()]

    engine, losses = run(("linear_cross_entropy",))
    head = engine._transform("fusion").loss_head
    assert not head.fused and "checked again with the model in bfloat16" in head.reason, head.reason
    assert "Mul" in head.reason and engine.plan.loss_head is None
    assert type(engine.module.lm_head) is nn.Linear
    _, stock = run(False)
    assert losses == pytest.approx(stock, rel=1e-6)


def test_a_fused_head_checked_again_in_bf16_says_so():
    torch.manual_seed(0)
    engine = Engine(TinyGPT(), lambda p: torch.optim.AdamW(p, lr=1e-2),
                    config=Config(device="cpu", precision="bf16-master", fuse=("linear_cross_entropy",)))
    engine.step(batches(1)[0])
    head = engine._transform("fusion").loss_head
    assert head.fused and head.checked_in is torch.bfloat16
    assert "dB in bfloat16" in engine.describe()
