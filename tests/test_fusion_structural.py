"""fuse(example=...) finds sites from data flow, whatever the modules are called: a user-written
GPT with its own names, and Hugging Face Llama, BERT and GPT-2 built from tiny configs. Each fused
model is checked against its unfused copy (logits and every grad) and its state_dict against a
fresh stock model; sites whose forward is not what the fused module computes are rolled back."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_fusion_rewrite import DIM, HEADS, MODEL_TOLERANCES, NanoBlock, assert_match, grad_of
from turbotrain.errors import FusionError
from turbotrain.fusion import FusedLinearAct, fuse
from turbotrain.fusion.patterns import activation_name

VOCAB, T = 128, 7
FP32 = MODEL_TOLERANCES[torch.float32]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, DIM))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in, self.act, self.fc_out = nn.Linear(DIM, 3 * DIM), nn.GELU(), nn.Linear(3 * DIM, DIM)

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))


class Block(NanoBlock):
    """A pre-norm block as nanoGPT's, holding this user's own attention and MLP."""

    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attention(), MLP()


class UserGPT(nn.Module):
    """Names in none of fusion's tables: q/k/v, fc_in/act/fc_out, blocks in a Sequential."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        return self.head(self.blocks(self.tok(idx)))


def hf():
    """transformers, imported when a test needs it (the rest of the file runs without it)."""
    return pytest.importorskip("transformers")


def llama():
    transformers = hf()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def bert():
    transformers = hf()
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=96, max_position_embeddings=64)
    return transformers.BertForMaskedLM(cfg)


def gpt2():
    transformers = hf()
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, -2:] = 0  # padding: the mask is one of the arguments the probe records
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, VOCAB, (2, T), generator=g)


def logits_of(model, batch):
    return model(**batch).logits if isinstance(batch, dict) else model(batch)


def fuse_and_compare(factory, batch, targets, **fuse_kwargs):
    """Fuse a model built by ``factory`` from data flow; logits and grads must equal the unfused copy's,
    and the state_dict must load into a fresh stock model. Returns (fused model, report)."""
    torch.manual_seed(0)
    model = factory()
    stock = copy.deepcopy(model)
    names = dict(model.named_parameters())
    example = ((), batch) if isinstance(batch, dict) else ((batch,), {})
    report = fuse(model, example=example, **fuse_kwargs)
    assert report.found_by == "data flow"
    model.eval(), stock.eval()  # dropout is not what is compared here
    out_f, out_s = logits_of(model, batch), logits_of(stock, batch)
    assert_match(out_f, out_s, FP32, "logits")
    F.cross_entropy(out_f.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(out_s.flatten(0, 1), targets.flatten()).backward()
    for name, p in names.items():
        ref = stock.get_parameter(name).grad
        if ref is None:
            continue  # unused by this forward in the stock model too (e.g. BERT's pooler-less head)
        g = grad_of(report, p)
        assert g is not None, f"{name} got no gradient"
        if name.endswith(("k.bias", "key.bias", "k_proj.bias")):
            continue  # analytically zero (softmax ignores a constant shift): both sides are noise
        assert_match(g, ref, FP32, f"grad {name}")
    check_state_dict(model, stock, factory)
    return model, report


def check_state_dict(model, stock, factory):
    fused_sd, stock_sd = model.state_dict(), stock.state_dict()
    assert fused_sd.keys() == stock_sd.keys()
    for k in stock_sd:
        assert torch.equal(fused_sd[k], stock_sd[k]), k
    torch.manual_seed(123)
    fresh = factory()
    fresh.load_state_dict(fused_sd, strict=True)


def sites(report, result="fused"):
    return sorted((s.path, s.pattern) for s in getattr(report, result))


def test_user_gpt_with_its_own_names():
    idx = torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(1))
    model, report = fuse_and_compare(UserGPT, idx, torch.randint(0, VOCAB, (3, T)))
    assert sites(report) == [("blocks.0.attn", "qkv"), ("blocks.0.mlp.fc_in", "linear_act"),
                             ("blocks.1.attn", "qkv"), ("blocks.1.mlp.fc_in", "linear_act")]
    assert not report.rolled_back
    assert isinstance(model.blocks[0].mlp.fc_in, FusedLinearAct) and type(model.blocks[0].mlp.act) is nn.Identity
    assert not fuse(UserGPT()).fused  # the name tables know none of these names


def test_user_gpt_verified_in_bf16():
    idx = torch.randint(0, VOCAB, (3, T))
    report = fuse(UserGPT(), dtype=torch.bfloat16, example=((idx,), {}))
    assert len(report.fused) == 4 and not report.rolled_back and report.verified_dtype is torch.bfloat16


def test_hf_llama_qkv_and_swiglu():
    batch, targets = hf_batch()
    model, report = fuse_and_compare(llama, batch, targets)
    assert sites(report) == [(f"model.layers.{i}.{m}", p) for i in range(2)
                             for m, p in (("mlp", "swiglu"), ("self_attn", "qkv"))]
    assert not report.rolled_back
    assert type(model.lm_head) is nn.Linear  # the linear+cross-entropy head is not fuse()'s


def test_hf_bert_qkv_and_linear_gelu():
    batch, targets = hf_batch()
    _, report = fuse_and_compare(bert, batch, targets)
    layers = [(f"bert.encoder.layer.{i}.{m}", p) for i in range(2)
              for m, p in (("attention.self", "qkv"), ("intermediate.dense", "linear_act"))]
    # BertPredictionHeadTransform is dense -> GELUActivation -> LayerNorm: one more pair.
    assert sites(report) == sorted(layers + [("cls.predictions.transform.dense", "linear_act")])
    assert not report.rolled_back


def test_hf_gpt2_conv1d_is_not_a_linear():
    # GPT-2's projections are transformers' Conv1D (a transposed weight), not nn.Linear: nothing to
    # fuse yet, and the probe and report must run cleanly anyway.
    batch, targets = hf_batch()
    _, report = fuse_and_compare(gpt2, batch, targets)
    assert not report.fused and not report.rolled_back and "0 fused" in str(report)


def test_filter_fn_excludes_by_fqn():
    asked = []

    def filter_fn(module, fqn):
        asked.append(module is model.get_submodule(fqn))  # the module at the site's path, still stock
        return not fqn.startswith("blocks.1.")

    model = UserGPT()
    report = fuse(model, example=((torch.randint(0, VOCAB, (2, T)),), {}), filter_fn=filter_fn)
    assert len(asked) == 4 and all(asked)
    assert sites(report, "excluded") == [("blocks.1.attn", "qkv"), ("blocks.1.mlp.fc_in", "linear_act")]
    assert {s.path for s in report.fused} == {"blocks.0.attn", "blocks.0.mlp.fc_in"}
    assert type(model.blocks[1].mlp.fc_in) is nn.Linear and not hasattr(model.blocks[1].attn, "qkv_fused")
    assert "excluded" in str(report)


class SwiGLU(nn.Module):
    def __init__(self, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = names
        for n, (i, o) in zip(names, ((DIM, 48), (DIM, 48), (48, DIM))):
            self.add_module(n, nn.Linear(i, o, bias=False))
        self.act = nn.SiLU()

    def parts(self):
        return (getattr(self, n) for n in self.names)

    def forward(self, x):
        gate, up, down = self.parts()
        return down(self.act(gate(x)) * up(x))


class ResidualSwiGLU(SwiGLU):
    def forward(self, x):
        return x + super().forward(x)


class AddedSwiGLU(SwiGLU):
    def forward(self, x):
        gate, up, down = self.parts()
        return down(self.act(gate(x)) + up(x))  # + where SwiGLU multiplies: only verification sees it


class DropoutSwiGLU(SwiGLU):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(super().forward(x))


class Holder(nn.Module):
    """A model around the module under test: a SwiGLU MLP is replaced in its owner."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)


def fuse_holder(mlp, **kwargs):
    holder = Holder(mlp)
    return holder, fuse(holder, example=((torch.randn(2, 5, DIM),), {}), **kwargs)


def test_swiglu_is_found_by_flow():
    holder, report = fuse_holder(SwiGLU())
    assert sites(report) == [("mlp", "swiglu")] and type(holder.mlp).__name__ == "FusedSwiGLUMLP"


def test_swiglu_under_other_names_is_fused_and_keeps_the_stock_layout():
    mlp = SwiGLU(names=("w1", "w3", "w2"))
    stock = copy.deepcopy(Holder(mlp))
    holder, report = fuse_holder(mlp)
    assert sites(report) == [("mlp", "swiglu")]
    state = holder.state_dict()
    assert set(state) == set(stock.state_dict())
    stock.load_state_dict(state)
    x = torch.randn(3, 4, DIM)
    torch.testing.assert_close(holder(x), stock(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mlp, reason", [
    (ResidualSwiGLU(), "returns something other than down_proj's output"),
    (DropoutSwiGLU(), "other children (drop)"),
    (AddedSwiGLU(), "verification failed"),
], ids=["residual", "dropout", "add-not-mul"])
def test_mlp_that_is_not_exactly_swiglu_is_rolled_back(mlp, reason):
    cls = type(mlp)
    holder, report = fuse_holder(mlp, patterns=("swiglu", "linear_act"))
    assert not report.fused, str(report)
    assert [s.pattern for s in report.rolled_back] == ["swiglu"] and reason in report.rolled_back[0].reason
    assert type(holder.mlp) is cls and type(holder.mlp.act) is nn.SiLU


def test_pre_activation_used_elsewhere_fails_verification_of_the_parent():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.proj = nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM)

        def forward(self, x):
            h = self.fc(x)
            return self.proj(self.act(h)) + h  # h itself is used too: act cannot move into fc

    holder, report = fuse_holder(Skip())
    assert sites(report, "rolled_back") == [("mlp.fc", "linear_act")]
    assert "verification failed" in report.rolled_back[0].reason and type(holder.mlp.fc) is nn.Linear


def test_activation_shared_by_two_linears_is_not_replaced():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.GELU()

        def forward(self, x):
            return self.act(self.a(x)) + self.act(self.b(x))

    holder, report = fuse_holder(Shared())
    assert sites(report, "rolled_back") == [("mlp.a", "linear_act")]
    assert "cannot become an Identity" in report.rolled_back[0].reason and type(holder.mlp.act) is nn.GELU


@pytest.mark.parametrize("cls_name, expected", [
    ("GELUActivation", "gelu"), ("NewGELUActivation", "gelu_tanh"), ("GELUTanh", "gelu_tanh"),
    ("SiLUActivation", "silu"), ("QuickGELUActivation", None), ("LinearActivation", None),
])
def test_transformers_activations_are_recognised_by_what_they_compute(cls_name, expected):
    assert activation_name(getattr(hf().activations, cls_name)()) == expected


def test_clipped_gelu_and_dropout_are_not_activations():
    assert activation_name(hf().activations.ClippedGELUActivation(-10.0, 10.0)) is None
    assert activation_name(nn.Dropout(0.5)) is None and activation_name(nn.Identity()) is None


def test_probe_leaves_no_trace():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 8), nn.ReLU())
    stats, x = model[1].running_mean.clone(), torch.randn(6, 4)
    rng = torch.get_rng_state()
    fuse(model, example=((x,), {}))  # verification runs the Sequential, BatchNorm and Dropout too
    assert torch.equal(model[1].running_mean, stats) and torch.equal(torch.get_rng_state(), rng)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert isinstance(model[3], FusedLinearAct)


def test_bad_example_is_a_fusion_error():
    with pytest.raises(FusionError, match="args, kwargs"):
        fuse(UserGPT(), example=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(FusionError, match="could not run on the example"):
        fuse(UserGPT(), example=((torch.zeros(1, 3),), {}))  # float ids: the embedding refuses


class FunctionalSwiGLU(nn.Module):
    """Meta's Llama FeedForward: the activation is a function call, and up is declared before gate."""

    def __init__(self, act=F.silu):
        super().__init__()
        self.act = act
        self.w3, self.w1, self.w2 = nn.Linear(DIM, 48, bias=False), nn.Linear(DIM, 48, bias=False), nn.Linear(48, DIM, bias=False)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def test_swiglu_with_a_functional_silu_is_found_by_its_values_and_matches():
    mlp = FunctionalSwiGLU()
    stock = copy.deepcopy(Holder(mlp))
    holder, report = fuse_holder(mlp)
    assert sites(report) == [("mlp", "swiglu")], str(report)
    assert holder.mlp.names == ("w1", "w3", "w2")  # gate is the Linear under the SiLU, whatever the order
    assert set(holder.state_dict()) == set(stock.state_dict())
    x = torch.randn(3, 4, DIM, requires_grad=True)
    torch.testing.assert_close(holder(x), stock(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", [F.gelu, torch.sigmoid], ids=["geglu", "sigmoid-glu"])
def test_a_gated_mlp_with_another_functional_activation_is_not_a_swiglu_site(act):
    holder, report = fuse_holder(FunctionalSwiGLU(act))
    assert not report.fused and not report.rolled_back, str(report)
    assert type(holder.mlp) is FunctionalSwiGLU


class FunctionalDropoutSwiGLU(FunctionalSwiGLU):
    """Dropout applied as a function on the hidden product: invisible to data flow, and absent in eval mode."""

    def forward(self, x):
        return self.w2(F.dropout(F.silu(self.w1(x)) * self.w3(x), 0.5, self.training))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_what_the_forward_does_in_one_mode_only_is_verified_whichever_mode_it_was_fused_in(training):
    mlp = FunctionalDropoutSwiGLU().train(training)
    holder, report = fuse_holder(mlp)
    assert not report.fused, str(report)
    assert type(holder.mlp) is FunctionalDropoutSwiGLU
    if not training:  # the eval-mode probe sees a SwiGLU; only the train-mode run tells it apart
        assert sites(report, "rolled_back") == [("mlp", "swiglu")]
        assert "in train mode" in report.rolled_back[0].reason, str(report)
