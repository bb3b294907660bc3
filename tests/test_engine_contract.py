"""Engine v2's contract with the user: their optimizer and scheduler objects, their batches, their loss,
and a consistent Engine after any error."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from turbotrain import Config, ConfigError, Engine, TurbotrainError
from turbotrain.comm import DataParallelConfig

F = nn.functional


class OwnLossLM(nn.Module):
    """nanoGPT's shape: forward(idx, targets) returns (logits, loss)."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.emb(idx))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class DictModel(nn.Module):
    """A Hugging Face-shaped model: keyword inputs, an output object with .loss when labels are given."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return type("Out", (), {"loss": loss, "logits": logits})()


class MeanPoolClassifier(nn.Module):
    """Not causal: every position reads every other, so right padding changes its output."""

    def __init__(self, vocab=32, d=16, classes=3, takes_mask=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.out = nn.Linear(d, classes)
        self.takes_mask = takes_mask
        if takes_mask:
            self.forward = self._masked_forward

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))

    def _masked_forward(self, ids, attention_mask=None):
        h = self.emb(ids)
        if attention_mask is None:
            return self.out(h.mean(1))
        m = attention_mask[..., None].to(h.dtype)
        return self.out((h * m).sum(1) / m.sum(1))


def ids(b=4, t=6, vocab=32, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_the_optimizer_passed_in_is_the_one_stepped_and_user_changes_take_effect():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = Engine(model, opt, F.cross_entropy, config=Config(device="cpu", precision="bf16-master"))
    assert engine.optimizer is opt
    batch = (torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))
    engine.step(batch)
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    engine.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_optimizer_and_scheduler_factory_are_built_over_the_transformed_parameters():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    seen = {}

    def make_opt(params):
        seen["params"] = list(params)
        return torch.optim.AdamW(seen["params"], lr=1e-2)

    engine = Engine(model, make_opt, F.cross_entropy, config=Config(device="cpu", precision="bf16-master"),
                    scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert all(p.dtype == torch.float32 for p in seen["params"])  # FP32 masters, not the bf16 model
    assert model[0].weight.dtype == torch.bfloat16
    engine.step((torch.randn(4, 8), torch.tensor([0, 1, 0, 1])))
    assert engine.scheduler.optimizer is engine.optimizer
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_foreign_optimizer_parameters_are_refused_and_missing_ones_named():
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="not the model's"):
        Engine(model, torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1), F.cross_entropy)
    with pytest.warns(UserWarning, match="bias"):
        Engine(model, torch.optim.SGD([model.weight], lr=0.1), F.cross_entropy)


def test_a_scheduler_on_another_optimizer_is_refused():
    model = nn.Linear(4, 2)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="another optimizer"):
        Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
               scheduler=torch.optim.lr_scheduler.StepLR(other, 1))


def test_onebit_adam_is_chosen_by_the_user_never_swapped_in():
    from turbotrain.comm.ddp import prepare

    with pytest.raises(ConfigError, match="OneBitAdam"):
        model = nn.Linear(4, 2)
        prepare(model, torch.optim.AdamW(model.parameters()), DataParallelConfig(compression="onebit"))


def test_a_dict_batch_is_passed_as_keywords_and_the_models_own_loss_trains():
    torch.manual_seed(0)
    model = DictModel()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=3e-2), config=Config(device="cpu"))
    x = ids()
    batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}
    losses = [float(engine.step(batch).loss) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


class PlainDictOutput(nn.Module):
    """A user's model that takes its own key names and returns a plain dict with a "loss" entry."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, targets=None):
        logits = self.head(self.emb(tokens))
        out = {"logits": logits}
        if targets is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return out


def test_a_model_returning_a_plain_dict_trains_on_its_loss_entry():
    torch.manual_seed(0)
    model = PlainDictOutput()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=3e-2), config=Config(device="cpu"))
    x = ids()
    losses = [float(engine.step({"tokens": x, "targets": x}).loss) for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0]
    with pytest.raises(ConfigError, match="returned a dict with no 0-d loss tensor; return the loss"):
        engine.step({"tokens": x})  # no targets, so no "loss" entry
    assert engine.steps == 20


class WholeSequenceLM(nn.Module):
    """Takes one tensor of token ids and scores each position on the next one itself."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, seq):
        logits = self.head(torch.tanh(self.emb(seq[:, :-1])))
        return F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())


def _dict_loss_fn(output, batch):
    return F.cross_entropy(output["logits"].flatten(0, 1), batch["targets"].flatten())


@pytest.mark.parametrize("case", ["dict-own-loss", "dict-loss-fn", "tensor-own-loss"])
def test_the_head_is_fused_where_the_runs_own_code_names_the_targets(case):
    # No 'labels' key and no (inputs, targets) pair to arm the head with: the cross-entropy call the
    # model (or the loss_fn) makes on the head's logits is the one computed fused.
    x = ids(t=9)
    build, loss_fn, batch = {
        "dict-own-loss": (PlainDictOutput, None, {"tokens": x, "targets": x}),
        "dict-loss-fn": (PlainDictOutput, _dict_loss_fn, {"tokens": x, "targets": x}),
        "tensor-own-loss": (WholeSequenceLM, None, x),
    }[case]
    losses = {}
    for fuse in (False, True):
        torch.manual_seed(0)
        model = build()
        engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=3e-2), loss_fn,
                        config=Config(device="cpu", precision="fp32", fuse=("linear_cross_entropy",) if fuse else None))
        losses[fuse] = [float(engine.step(batch).loss) for _ in range(4)]
        if fuse:
            head = engine._transform("fusion").loss_head
            assert head.fused and head.path == "head", head.reason
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


class FloatLogitsOwnLoss(PlainDictOutput):
    """Meta's Llama code returns ``self.output(h).float()``: the logits change dtype before the loss."""

    def forward(self, tokens, targets=None):
        logits = self.head(self.emb(tokens)).float()
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten())}


def test_the_own_loss_head_survives_the_logits_cast_to_fp32_in_a_bf16_run():
    # The set-up check runs before the model is cast to bf16, where .float() changes nothing; in the
    # run it turned the placeholder into a tensor of zeros and the first step failed.
    x = ids(t=9)
    losses = {}
    for fuse in (False, True):
        torch.manual_seed(0)
        model = FloatLogitsOwnLoss()
        engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=3e-2),
                        config=Config(device="cpu", precision="bf16-master",
                                      fuse=("linear_cross_entropy",) if fuse else None))
        losses[fuse] = [float(engine.step({"tokens": x, "targets": x}).loss) for _ in range(4)]
        if fuse:
            assert engine._transform("fusion").loss_head.fused
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)


def test_a_dict_batch_with_a_loss_fn_gets_the_whole_batch():
    model = DictModel()
    got = {}

    def loss_fn(output, batch):
        got["keys"] = sorted(batch)
        return F.cross_entropy(output.logits.flatten(0, 1), batch["target"].flatten())

    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, config=Config(device="cpu"))
    with pytest.raises(ConfigError, match="key 'target' is not an argument"):  # every key is passed to the model
        engine.step({"input_ids": ids(), "target": ids()})
    assert engine.steps == 0


def test_a_tuple_batch_without_loss_fn_uses_the_models_forward_targets():
    torch.manual_seed(0)
    model = OwnLossLM()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=3e-2), config=Config(device="cpu"))
    x = ids()
    losses = [float(engine.step((x, x)).loss) for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("loss_fn, match", [
    (lambda out, t: F.cross_entropy(out, t, reduction="none"), r"shape \([24],\).*reduction='mean'"),
    (lambda out, t: 3, "not a tensor"),
    (lambda out, t: torch.tensor(3), "0-d floating"),
    (lambda out, t: F.cross_entropy(out, t).detach(), "does not require grad"),
    (lambda out, t: (F.cross_entropy(out, t), {"acc": 0.5}),
     r"a tuple of 2 starting with a 0-d tensor: return the loss alone"),
])
@pytest.mark.parametrize("fuse", [False, ("linear_cross_entropy",)])
def test_a_loss_that_is_not_a_0d_float_with_grad_is_refused(loss_fn, match, fuse):
    """Also where the fused head's set-up reads the loss first (it read a tuple's .grad_fn)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, config=Config(device="cpu", fuse=fuse))
    with pytest.raises(ConfigError, match=match):
        engine.step((torch.randn(4, 8), torch.tensor([0, 1, 2, 0])))
    assert engine.steps == 0


def test_a_dict_batch_key_the_model_does_not_take_is_named():
    model = DictModel()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), config=Config(device="cpu"))
    batch = {"input_ids": ids(), "labels": ids(), "row_ids": torch.arange(4), "text": ["a"] * 4}
    with pytest.raises(ConfigError, match=r"keys 'row_ids', 'text' are not an argument of DictModel.forward"):
        engine.step(batch)
    assert engine.steps == 0
    del batch["row_ids"], batch["text"]
    assert torch.isfinite(engine.step(batch).loss)  # the Engine stays usable


def test_a_model_without_its_own_loss_says_what_it_returned():
    model = nn.Linear(8, 3)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), config=Config(device="cpu"))
    with pytest.raises(ConfigError, match=r"shape \(4, 3\)"):
        engine.step(torch.randn(4, 8))
    model = DictModel()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), config=Config(device="cpu"))
    with pytest.raises(ConfigError, match="'labels'"):
        engine.step({"input_ids": ids()})


@pytest.mark.parametrize("bad, match", [
    ((torch.randn(0, 8), torch.zeros(0, dtype=torch.long)), "empty tensor"),
    ({}, "empty mapping"),
    ({1: torch.zeros(2)}, "keys must be strings"),
    ([1, 2, 3], "a batch must be"),
    ((torch.randn(2, 8), torch.ones(2, 8), torch.zeros(2, dtype=torch.long)), "of length 3; for more than one input"),
])
def test_bad_batches_are_refused_before_any_work(bad, match):
    model = nn.Linear(8, 3)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, config=Config(device="cpu"))
    with pytest.raises(ConfigError, match=match):
        engine.step(bad)
    assert engine.steps == 0


def test_after_a_caught_nan_error_the_next_good_batch_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                    config=Config(device="cpu", nan_check=True, accumulate=2))
    good = (torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    engine.step(good)  # half-way through an accumulated step
    bad = (torch.full((4, 8), float("nan")), good[1])
    with pytest.raises(TurbotrainError, match="inf/NaN"):
        engine.step(bad)
    assert all(p.grad is None for p in model.parameters())
    stats = [engine.step(good) for _ in range(2)]
    assert stats[-1].optimizer_stepped and engine.steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_seq_buckets_refuse_to_pad_a_model_that_takes_no_mask():
    model = MeanPoolClassifier()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                    config=Config(device="cpu", seq_buckets=(8,)))
    with pytest.raises(ConfigError, match="attention_mask"):
        engine.step((ids(t=6), torch.tensor([0, 1, 2, 0])))


def test_seq_buckets_pass_a_mask_so_a_non_causal_loss_is_unchanged():
    torch.manual_seed(0)
    model = MeanPoolClassifier(takes_mask=True)
    x, y = ids(t=6), torch.tensor([0, 1, 2, 0])
    plain = F.cross_entropy(model(x), y)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), F.cross_entropy,
                    config=Config(device="cpu", seq_buckets=(8,)))
    torch.testing.assert_close(engine.step((x, y)).loss, plain.detach())


def test_seq_buckets_pad_a_dict_batch_with_its_mask_and_labels():
    torch.manual_seed(0)
    model = DictModel()
    x = ids(t=6)
    mask = torch.ones_like(x)
    mask[0, -2:] = 0
    labels = x.masked_fill(mask == 0, -100)
    plain = model(input_ids=x, attention_mask=mask, labels=labels).loss
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), config=Config(device="cpu", seq_buckets=(8,)))
    torch.testing.assert_close(engine.step({"input_ids": x, "attention_mask": mask, "labels": labels}).loss,
                               plain.detach())


def test_config_must_be_a_config():
    with pytest.raises(ConfigError, match="turbotrain.Config"):
        Engine(nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), config={"precision": "fp32"})


def test_no_warning_for_a_plain_fp32_run():
    model = nn.Linear(8, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, config=Config(device="cpu"))
        engine.step((torch.randn(8, 8), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])))


def _gpt(seed=0):
    from turbotrain.workloads import get_workload

    work = get_workload("gpt", d=32, n_layer=2, n_head=4, T=16, B=4, vocab_size=512)
    stream = work.batches("train", seed=seed)
    return work, [next(stream) for _ in range(6)]


def test_with_fusion_the_users_optimizer_is_stepped_and_lr_zero_freezes_the_model():
    work, data = _gpt()
    model = work.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine(model, opt, work.loss_fn, config=Config(device="cpu", fuse=("qkv", "linear_cross_entropy")))
    engine.step(data[0])
    assert engine.optimizer is opt and engine.fusion_report.fused
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.step(data[1])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_fusion_summary_counts_the_fused_loss_head():
    """The head is fused outside the rewrite; the counts line used to say '0 fused' above its row."""
    work, data = _gpt()
    model = work.build_model()
    engine = Engine(model, torch.optim.AdamW(model.parameters()), work.loss_fn,
                    config=Config(device="cpu", fuse=("linear_cross_entropy",)))
    engine.step(data[0])
    text = engine._transform("fusion").describe()
    assert text.startswith("fusion: 1 fused, 0 rolled back"), text
    assert [line.split()[1:3] for line in text.splitlines()[2:]] == [["linear_cross_entropy", "fused"]]


@pytest.mark.parametrize("first, second", [(("qkv", "linear_cross_entropy"), False),
                                           (False, ("qkv", "linear_cross_entropy"))])
def test_a_fused_run_resumes_unfused_and_back_with_the_same_losses(tmp_path, first, second):
    """Model and optimizer state are saved in the stock layout, so the resumed run continues exactly."""
    work, data = _gpt()

    def engine(fuse):
        torch.manual_seed(0)
        model = work.build_model()
        return Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), work.loss_fn,
                      config=Config(device="cpu", fuse=fuse))

    straight = engine(first)
    losses = [float(straight.step(b).loss) for b in data]
    saved = engine(first)
    for b in data[:3]:
        saved.step(b)
    saved.save(tmp_path / "ck.pt")
    with pytest.warns(UserWarning, match="different config"):
        resumed = Engine.load(tmp_path / "ck.pt", work.build_model(), lambda p: torch.optim.AdamW(p, lr=1e-2),
                              work.loss_fn, config=Config(device="cpu", fuse=second))
    after = [float(resumed.step(b).loss) for b in data[3:]]
    assert resumed.steps == 6
    # fused and unfused kernels sum in another order: equal to fp32 rounding, not bitwise
    torch.testing.assert_close(torch.tensor(after), torch.tensor(losses[3:]), rtol=1e-4, atol=1e-5)


def test_a_checkpoint_of_another_optimizer_class_is_refused(tmp_path):
    work, data = _gpt()
    model = work.build_model()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), work.loss_fn, config=Config(device="cpu"))
    engine.step(data[0])
    engine.save(tmp_path / "ck.pt")
    from turbotrain import CheckpointError

    model = work.build_model()
    with pytest.raises(CheckpointError, match="AdamW"):
        Engine.load(tmp_path / "ck.pt", model, torch.optim.SGD(model.parameters(), lr=0.1), work.loss_fn,
                    config=Config(device="cpu"))


def test_nan_check_on_a_dict_batch_with_a_finite_forward_reports_the_backward():
    # The finder replays the loss with the output and no targets: the contract's loss for a dict
    # batch (the model's own) must take that call, or the report of a NaN born in backward (the
    # forward all finite, so the finder reaches the loss) becomes a TypeError.
    class SqrtAtZero(DictModel):
        def forward(self, input_ids, attention_mask=None, labels=None):
            out = super().forward(input_ids, attention_mask, labels)
            out.loss = out.loss + torch.sqrt(self.head.bias[:1] * 0).sum()  # 0 forward, NaN gradient
            return out

    torch.manual_seed(0)
    model = SqrtAtZero()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), config=Config(device="cpu", nan_check=True))
    ids = torch.randint(0, 32, (2, 5))
    with pytest.raises(TurbotrainError, match="inf/NaN appeared"):
        engine.step({"input_ids": ids, "labels": ids})


class DropoutNormNet(nn.Module):
    """Dropout and BatchNorm between fusable Linears and a head: everything set-up runs could disturb."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up, self.act, self.drop = nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.3)
        self.norm = nn.BatchNorm1d(2 * d)
        self.head = nn.Linear(2 * d, vocab)

    def forward(self, idx):
        h = self.drop(self.act(self.up(self.emb(idx))))
        return self.head(self.norm(h.transpose(1, 2)).transpose(1, 2))


@pytest.mark.parametrize("config", [Config(device="cpu", fuse="all"), Config(device="cpu", keep_fp32_head=True)],
                         ids=["fuse", "keep_fp32_head"])
def test_set_up_draws_no_random_numbers_and_moves_no_running_statistics(config):
    """The forwards set-up runs (finding the head, probing, verifying) leave the run as a plain loop
    would have it: the same dropout masks at every step and the same BatchNorm statistics."""
    data = [(torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i)),) * 2 for i in range(3)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    plain = DropoutNormNet()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    expected = []
    for x, y in data:
        loss = loss_fn(plain(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss))
    torch.manual_seed(0)
    model = DropoutNormNet()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, config=config)
    got = [float(engine.step(b).loss) for b in data]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    torch.testing.assert_close(model.norm.running_mean, plain.norm.running_mean, rtol=1e-5, atol=1e-7)
    assert int(model.norm.num_batches_tracked) == len(data)


class ScaledLogits(nn.Module):
    """The logits are computed after a Linear's output was freed: with glibc's malloc they land at
    the freed output's address."""

    def __init__(self):
        super().__init__()
        self.emb, self.proj = nn.Embedding(32, 16), nn.Linear(16, 512)

    def forward(self, idx):
        a = self.proj(self.emb(idx))
        h = torch.tanh(a)
        del a
        return h * 2


def test_the_head_is_not_matched_by_the_address_of_a_freed_linear_output():
    from turbotrain.plan import find_head

    model, idx = ScaledLogits(), torch.zeros(4, 8, dtype=torch.long)
    assert find_head(model, lambda: model(idx)) is None  # no Linear returns these logits


class PostHeadLM(nn.Module):
    """An LM whose loss does something to the logits after the head (or not: "none", "float", "scale1")."""

    def __init__(self, what: str, vocab=32, d=16):
        super().__init__()
        self.what = what
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        if self.what == "softcap":
            logits = torch.tanh(logits / 30.0) * 30.0
        elif self.what == "scale":
            logits = logits / 8.0
        elif self.what == "scale1":
            logits = logits / 1.0
        elif self.what == "float":
            logits = logits.float()
        if labels is None:
            return SimpleNamespace(loss=None, logits=logits)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if self.what == "zloss":
            loss = loss + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()
        return SimpleNamespace(loss=loss, logits=logits)  # an output object, as transformers returns

    def get_output_embeddings(self):  # as transformers models say which Linear is the head
        return self.head


@pytest.mark.parametrize("what, fused", [("none", True), ("float", True), ("scale1", True),
                                         ("softcap", False), ("scale", False), ("zloss", False)])
def test_the_loss_head_is_fused_only_when_the_logits_go_straight_into_cross_entropy(what, fused):
    """A soft cap changes the loss of an initialised model's small logits by ~1e-7, under the loss
    check's tolerance; the graph check is what refuses it."""
    torch.manual_seed(0)
    model = PostHeadLM(what)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    config=Config(device="cpu", fuse=("linear_cross_entropy",)))
    engine.step({"input_ids": ids, "labels": ids})
    head = engine._transform("fusion").loss_head
    assert head.fused is fused, head.reason
    if not fused and what != "zloss":
        assert "before the loss's log-softmax" in head.reason, head.reason


class TupleLM(nn.Module):
    """An LM trained on (ids, targets) with a loss_fn; ``out`` = "logits", or "log_probs" as PyTorch's
    word-language-model example returns them for an NLL loss ("log_probs_flat": flattened first, the
    softmax over dim 1; "log_probs_dim0": over the wrong dimension)."""

    def __init__(self, out="logits", vocab=64, d=16):
        super().__init__()
        self.out, self.vocab = out, vocab
        self.emb, self.mix, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, ids):
        logits = self.head(torch.tanh(self.mix(self.emb(ids))))
        if self.out == "log_probs":
            return F.log_softmax(logits, dim=-1)
        if self.out == "log_probs_flat":
            return F.log_softmax(logits.view(-1, self.vocab), dim=1)
        if self.out == "log_probs_dim0":
            return F.log_softmax(logits, dim=0)
        return logits


def _nll(out, targets):
    return F.nll_loss(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _cross_entropy(out, targets):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _tuple_batches(n=3, vocab=64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (4, 8), generator=g), torch.randint(0, vocab, (4, 8), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("out, head", [("logits", "head"), ("log_probs", "head"), ("log_probs_flat", "head"),
                                       ("log_probs_dim0", None)])
def test_the_head_of_a_model_that_returns_log_probabilities_is_found(out, head):
    from turbotrain.plan import find_head

    model, (ids, _) = TupleLM(out), _tuple_batches(1)[0]
    assert find_head(model, lambda: model(ids)) == head


@pytest.mark.parametrize("out", ["log_probs", "log_probs_flat"])
def test_a_model_that_returns_log_probabilities_for_an_nll_loss_trains_with_the_fused_head(out):
    losses, evals = {}, {}
    for fuse in (False, True):
        torch.manual_seed(0)
        model = TupleLM(out)
        engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _nll,
                        config=Config(device="cpu", precision="fp32", fuse=("linear_cross_entropy",) if fuse else None))
        losses[fuse] = [float(engine.step(b).loss) for b in _tuple_batches()]
        evals[fuse] = engine.eval_loss(_tuple_batches(4)[3:])
        if fuse:
            head = engine._transform("fusion").loss_head
            assert head.fused and head.path == "head", head.reason
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert evals[True] == pytest.approx(evals[False], rel=1e-5)


def _smoothed(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), label_smoothing=0.05)


def _smoothed_by_hand(out, y):
    logp = F.log_softmax(out.float(), -1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return (0.95 * nll - 0.05 * logp.mean(-1)).mean()


def _class_weights(out, y):
    weight = torch.linspace(0.5, 2.0, out.shape[-1])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), weight=weight)


def _nll_by_index(out, y):
    logp = F.log_softmax(out.reshape(-1, out.shape[-1]), -1)
    return -logp[torch.arange(logp.shape[0]), y.reshape(-1)].mean()


def _masked_mean(out, y):  # per-token losses masked by something other than the targets
    per_token = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none")
    keep = (torch.arange(per_token.numel()) % 8 < 6).float()
    return (per_token * keep).sum() / keep.sum()


def _twice(out, y):
    flat, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return F.cross_entropy(flat, y) + 0.01 * F.cross_entropy(flat[:4], y[:4])


def _nll_weighted(out, y):
    weight = torch.linspace(0.95, 1.05, out.shape[-1])
    return F.nll_loss(F.log_softmax(out.reshape(-1, out.shape[-1]), -1), y.reshape(-1), weight=weight)


@pytest.mark.parametrize("loss_fn, refused", [
    (_smoothed_by_hand, "label smoothing written out"), (_nll_weighted, "weights the classes with nll_loss"),
    (_nll_by_index, "picks the targets' log-probabilities itself"), (_masked_mean, "per-token losses"),
    (_twice, "2 cross-entropy terms"),
    (lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)), None),
    (_smoothed, None), (_class_weights, None),
], ids=["smoothing-by-hand", "nll-class-weights", "nll-by-index", "masked-mean", "twice", "cross-entropy",
        "label-smoothing", "class-weights"])
def test_a_loss_the_fused_head_would_not_reproduce_on_every_batch_keeps_its_head(loss_fn, refused):
    # In bf16 a smoothing of 0.05 moves the head's gradient by about 26 dB and the loss by 2e-4: the
    # numerical check (20 dB, 2e-2) fused it, and a smoothing the kernel did not compute was dropped
    # without a word. F.cross_entropy's own label_smoothing and weight= it computes (the test below);
    # written out by hand they stay unfused. A mask or per-token weights agree with the fused mean on
    # a first batch without padding, and not after.
    torch.manual_seed(0)
    model = TupleLM("logits", vocab=512)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn,
                    config=Config(device="cpu", precision="bf16-master", fuse=("linear_cross_entropy",)))
    engine.step(_tuple_batches(1, vocab=512)[0])
    head = engine._transform("fusion").loss_head
    if refused is None:
        assert head.fused, head.reason
    else:
        assert not head.fused and refused in head.reason, head.reason


def _stock_and_fused(loss_fn, batches, lr, precision="fp32"):
    """((losses, engine) without fusion, (losses, engine) with the fused loss head), each a TupleLM from
    seed 0 trained by SGD on ``batches``."""
    runs = []
    for fuse in (None, ("linear_cross_entropy",)):
        torch.manual_seed(0)
        model = TupleLM()
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=lr), loss_fn,
                        config=Config(device="cpu", precision=precision, fuse=fuse))
        runs.append(([float(engine.step(b).loss) for b in batches], engine))
    return runs


def _smoothed_and_weighted(out, y):
    weight = torch.linspace(0.5, 1.5, out.shape[-1])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), weight=weight, label_smoothing=0.2,
                           ignore_index=-1)


_SMOOTHING_MODULE = nn.CrossEntropyLoss(label_smoothing=0.2, reduction="sum")


@pytest.mark.parametrize("loss_fn, pad", [
    (_smoothed, -100), (_class_weights, -100), (_smoothed_and_weighted, -1),
    (lambda out, y: _SMOOTHING_MODULE(out.reshape(-1, out.shape[-1]), y.reshape(-1)) / 50.0, -100),
], ids=["label-smoothing", "class-weights", "both", "module-sum"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_label_smoothing_and_class_weights_are_computed_by_the_fused_head(loss_fn, pad, precision):
    # They go through the loss's own cross-entropy call, so the settings and whatever the loss does
    # around the call (a division by a token count) stay. The later batches carry padding (the loss's
    # ignore_index), where a weighted mean divides by the kept targets' summed weights.
    batches = _tuple_batches(5)
    batches[1][1][:, 5:] = pad
    batches[2][1][:, 2:] = pad
    batches[3][1][0] = pad
    (stock, stock_engine), (fused, engine) = _stock_and_fused(loss_fn, batches[:-1], lr=0.5, precision=precision)
    head = engine._transform("fusion").loss_head
    assert head.fused and head.through_loss, head.reason
    tol = 1e-5 if precision == "fp32" else 5e-3
    assert fused == pytest.approx(stock, rel=tol)
    assert engine.eval_loss(batches[-1:]) == pytest.approx(stock_engine.eval_loss(batches[-1:]), rel=tol)
    fused_w, stock_w = (e.module.head.weight.detach().float() for e in (engine, stock_engine))
    assert float((fused_w - stock_w).norm() / stock_w.norm()) < tol  # bf16: a weight may be one ulp apart


@pytest.mark.parametrize("loss_fn, through", [
    (lambda out, y: F.cross_entropy(out.transpose(1, 2), y, ignore_index=-1), False),
    (lambda out, y: F.cross_entropy(out.transpose(1, 2), y, label_smoothing=0.1, ignore_index=-1), True),
    (lambda out, y: F.cross_entropy(out.permute(0, 2, 1), y, reduction="sum", ignore_index=-1) / y.numel(), True),
], ids=["plain", "smoothing", "sum-over-tokens"])
def test_a_cross_entropy_on_logits_with_the_classes_on_dim_1_is_fused(loss_fn, through):
    # F.cross_entropy(logits.transpose(1, 2), y) scores (N, C, T) against (N, T): the same loss. Its
    # autograd node is NllLoss2DBackward0, which the graph walk did not know, so the head was refused
    # as if the loss had summed over the classes; answering the call must move the classes back.
    batches = _tuple_batches(4)
    batches[2][1][:, 3:] = -1
    (stock, _), (fused, engine) = _stock_and_fused(loss_fn, batches, lr=0.5)
    head = engine._transform("fusion").loss_head
    assert head.fused and head.through_loss == through, head.reason
    assert fused == pytest.approx(stock, rel=1e-5)


@pytest.mark.parametrize("ignore_index, reduction", [(-1, "mean"), (-100, "sum"), (-1, "sum")])
def test_the_fused_head_takes_the_losss_ignore_index_and_reduction(ignore_index, reduction):
    # The first batch has nothing to ignore, so the set-up check passes whatever the fused head
    # ignores; the later batches' padding (-1, as nanoGPT pads) must then be ignored as the loss does.
    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=ignore_index,
                               reduction=reduction)

    batches = _tuple_batches(4)
    batches[1][1][:, 5:] = ignore_index
    batches[2][1][:, 2:] = ignore_index
    if reduction == "sum":  # a batch of padding only: a summed loss of 0, nothing learned (not NaN)
        batches[3][1][:] = ignore_index
    (stock, _), (fused, engine) = _stock_and_fused(loss_fn, batches, lr=0.1)
    assert engine._transform("fusion").loss_head.fused
    assert fused == pytest.approx(stock, rel=1e-5)


@pytest.mark.parametrize("frozen", [("head.weight",), ("head.weight", "emb.weight", "mix.weight", "mix.bias")])
def test_a_frozen_head_is_fused_on_its_input_gradient(frozen):
    # A LoRA-style fine-tune freezes the output layer: the set-up check compares the gradient the
    # loss sends into the head instead of the head weight's. Where only the head's bias trains
    # (BitFit), there is no gradient below the head to check and the head stays as it was.
    losses = {}
    for fuse in (False, True):
        torch.manual_seed(0)
        model = TupleLM()
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)
        engine = Engine(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                        _cross_entropy,
                        config=Config(device="cpu", precision="fp32", fuse=("linear_cross_entropy",) if fuse else None))
        losses[fuse] = [float(engine.step(b).loss) for b in _tuple_batches()]
        if fuse:
            head = engine._transform("fusion").loss_head
            if len(frozen) == 1:
                assert head.fused and head.grad_of == "input", head.reason
                assert "head input grad sqnr" in engine.describe()
            else:
                assert not head.fused and "frozen" in head.reason, head.reason
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
