"""Models handed to the Engine the way users often have them already: wrapped by ``torch.compile``, or
cast to bf16 (``from_pretrained(torch_dtype=torch.bfloat16)``)."""

import warnings

import pytest
import torch
from torch import nn

from turbotrain import Config, Engine

F = nn.functional
VOCAB, D = 40, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.ln = nn.LayerNorm(D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        return self.head(self.ln(torch.tanh(self.mix(self.emb(ids)))))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches(n=4):
    g = torch.Generator().manual_seed(0)
    return [(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
            for ids in (torch.randint(0, VOCAB, (4, 9), generator=g) for _ in range(n))]


def test_a_compiled_model_is_trained_through_the_engines_own_compile_and_said_once():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLM()
    with pytest.warns(UserWarning, match="wrapped by torch.compile") as caught:
        engine = Engine(torch.compile(model), lambda p: torch.optim.AdamW(p, lr=1e-2), lm_loss,
                        config=Config(device="cpu", precision="fp32", fuse=("linear_cross_entropy",)))
    assert sum("wrapped by torch.compile" in str(w.message) for w in caught) == 1
    assert engine.module is model and engine.config.compile
    stats = [engine.step(b) for b in batches()]
    # The set-up's checks (hooks added and removed) recompiled nothing: the step is one compiled graph.
    assert stats[-1].recompiles == 0
    assert engine._transform("fusion").loss_head.fused
    assert set(engine.state_dict()["model"]) == set(TinyLM().state_dict())  # no "_orig_mod." prefix

    torch.manual_seed(0)
    stock = TinyLM()
    opt = torch.optim.AdamW(stock.parameters(), lr=1e-2)
    expected = []
    for x, y in batches():
        loss = lm_loss(stock(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(float(loss))
    assert [float(s.loss) for s in stats] == pytest.approx(expected, rel=1e-4)


def test_a_bf16_model_under_bf16_master_keeps_its_norms_fp32_so_they_train():
    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)
    engine = Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-3), lm_loss,
                    config=Config(device="cpu", precision="bf16-master"))
    for b in batches():
        engine.step(b)
    assert model.ln.weight.dtype == torch.float32
    # An update of 1e-3 on a weight of 1.0 is below bf16's resolution there (2^-8): held in bf16 it never moves.
    assert (model.ln.weight - 1.0).abs().max() > 1e-3
    assert model.mix.weight.dtype == torch.bfloat16


def test_fp32_on_a_bf16_model_says_that_it_trains_in_bf16():
    model = TinyLM().to(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"precision='fp32', but 7 of the model's parameters are bfloat16"):
        engine = Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-3), lm_loss, config=Config(device="cpu"))
        engine.step(batches(1)[0])
    assert model.mix.weight.dtype == torch.bfloat16  # the model's dtype is the user's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.step(batches(1)[0])  # said once
