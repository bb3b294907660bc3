"""fuse() on user-style models: outputs and grads match unfused, state_dict keeps the stock layout,
broken sites are rolled back, and the optimizer can be re-pointed. Models whose names are in the
fallback tables are fused both ways, by names and by data flow, with the same result."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from turbotrain.errors import ConfigError, FusionError
from turbotrain.fusion import FusedLinearAct, FusionReport, fuse, sqnr
from turbotrain.workloads.base import cross_entropy_loss

VOCAB, DIM, HEADS = 97, 32, 4


class HFAttention(nn.Module):
    """Llama-style attention, HF naming."""

    def __init__(self, d=DIM, heads=HEADS, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, attention_mask=None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class HFMLP(nn.Module):
    def __init__(self, d=DIM, hidden=3 * DIM - 5):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class HFLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.self_attn, self.mlp = HFAttention(), HFMLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class HFModel(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(HFLayer() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class NanoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, HEADS, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class NanoMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(DIM, 4 * DIM), nn.GELU(approximate="tanh"), nn.Linear(4 * DIM, DIM)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.proj(self.act(self.fc(x))))


class NanoBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(DIM), NanoAttention(), nn.LayerNorm(DIM), NanoMLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.h = nn.ModuleList(NanoBlock() for _ in range(layers))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, which fusion must keep

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def user_mlp():
    return nn.Sequential(nn.Linear(13, 37), nn.ReLU(), nn.LayerNorm(37), nn.GELU(), nn.Linear(37, 41),
                         nn.SiLU(), nn.Linear(41, 5))


# Tolerances per dtype, for whole models compared against their unfused copy.
MODEL_TOLERANCES = {
    # fp32: only summation order differs between fused and stock.
    torch.float32: {"rel": 1e-4},
    # bf16: fused keeps fp32 where stock rounds to bf16, through two layers; 25 dB is well above noise
    # from a real bug (a wrong slice or a missing term is ~0 dB).
    torch.bfloat16: {"sqnr": 25.0},
}


def assert_match(test, ref, tol, what):
    test, ref = test.double(), ref.double()
    if "rel" in tol:
        err = (test - ref).abs().max().item()
        # The floor keeps a near-zero reference (e.g. a tiny bias grad) from demanding 1e-10.
        assert err <= tol["rel"] * max(ref.abs().max().item(), 1e-3), f"{what}: max error {err}"
    else:
        assert sqnr(ref, test) >= tol["sqnr"], f"{what}: sqnr {sqnr(ref, test):.1f} dB"


def lm_batch(t=9):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (3, t), generator=g)
    targets = torch.randint(0, VOCAB, (3, t), generator=g)
    targets[0, -3:] = -100
    return idx, targets


def mlp_input(dtype=torch.float32):
    return torch.randn(5, 123, 13, generator=torch.Generator().manual_seed(5)).to(dtype)


def example_for(factory):
    """(args, kwargs) the model is called with, for fuse(example=...)."""
    return ((mlp_input(),), {}) if factory is user_mlp else ((lm_batch()[0],), {})


def fused_and_stock(factory, dtype, patterns=None, by="names"):
    torch.manual_seed(0)
    model = factory()
    stock = copy.deepcopy(model)
    names = dict(model.named_parameters())
    kwargs = {} if patterns is None else {"patterns": patterns}
    if by == "flow":
        kwargs["example"] = example_for(factory)
    report = fuse(model, dtype=dtype, **kwargs)
    assert report.found_by == ("data flow" if by == "flow" else "names")
    model.to(dtype), stock.to(dtype)  # the Engine casts after fusing
    return model, stock, names, report


def grad_of(report, original_param):
    target = report.param_map.get(original_param, original_param)
    if isinstance(target, tuple):
        return target[0].grad[target[1]]
    return target.grad


def check_model(factory, dtype, loss_of, expect_patterns, by="names"):
    model, stock, names, report = fused_and_stock(factory, dtype, by=by)
    assert not report.rolled_back, str(report)
    assert {s.pattern for s in report.fused} == set(expect_patterns), str(report)
    tol = MODEL_TOLERANCES[dtype]
    loss_f, loss_s = loss_of(model), loss_of(stock)
    assert_match(loss_f, loss_s, tol if "rel" in tol else {"rel": 2e-2}, "loss")
    loss_f.backward()
    loss_s.backward()
    for name, p in names.items():
        if name.endswith("k_proj.bias"):
            continue  # analytically zero (softmax ignores a constant shift): both sides are noise
        g = grad_of(report, p)
        assert g is not None, f"{name} got no gradient"
        assert_match(g, stock.get_parameter(name).grad, tol, f"grad {name}")
    return model, stock, report


DTYPE_IDS = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
FINDERS = [pytest.param("names", id="by-names"), pytest.param("flow", id="by-flow")]


@pytest.mark.parametrize("by", FINDERS)
@pytest.mark.parametrize("dtype", DTYPE_IDS)
def test_user_mlp_in_sequential(dtype, by):
    x = mlp_input(dtype)
    model, _, report = check_model(user_mlp, dtype, lambda m: m(x).float().square().mean(),
                                   {"linear_act", "layernorm_gelu"}, by=by)
    assert [s.path for s in report.fused] == ["0", "2", "4"]
    assert isinstance(model[0], FusedLinearAct) and isinstance(model[1], nn.Identity)


@pytest.mark.parametrize("by", FINDERS)
@pytest.mark.parametrize("dtype", DTYPE_IDS)
def test_hf_style_attention_and_swiglu(dtype, by):
    idx, targets = lm_batch()
    model, _, report = check_model(HFModel, dtype, lambda m: cross_entropy_loss(m(idx), targets),
                                   {"qkv", "swiglu"}, by=by)
    qkv = model.layers[0].self_attn.qkv_fused
    assert qkv.weight.shape == (DIM + 2 * 2 * DIM // HEADS, DIM)  # ONE concatenated parameter
    assert type(model.lm_head) is nn.Linear  # the head is the Engine's loss path, not fuse()'s


@pytest.mark.parametrize("by", FINDERS)
@pytest.mark.parametrize("dtype", DTYPE_IDS)
def test_nanogpt_style_block(dtype, by):
    idx, targets = lm_batch()
    model, _, report = check_model(NanoGPT, dtype, lambda m: cross_entropy_loss(m(idx), targets),
                                   {"qkv", "linear_act"}, by=by)
    assert model.lm_head.weight is model.wte.weight  # tying survived


def test_linear_cross_entropy_is_accepted_and_left_alone():
    model = HFModel(layers=1)
    report = fuse(model, patterns=("linear_cross_entropy",), example=example_for(HFModel))
    assert not report.fused and not report.rolled_back and type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("by", FINDERS)
@pytest.mark.parametrize("factory", [HFModel, NanoGPT, user_mlp])
def test_state_dict_keeps_stock_layout_both_ways(factory, by):
    model, stock, _, _ = fused_and_stock(factory, torch.float32, by=by)
    fused_sd, stock_sd = model.state_dict(), stock.state_dict()
    assert fused_sd.keys() == stock_sd.keys()
    for k in stock_sd:
        assert torch.equal(fused_sd[k], stock_sd[k]), k
    # fused -> fresh stock model
    torch.manual_seed(123)
    fresh = factory()
    fresh.load_state_dict(fused_sd)
    # stock (perturbed) -> fused model, strictly
    perturbed = {k: v + 1.0 if v.is_floating_point() else v for k, v in stock_sd.items()}
    model.load_state_dict(perturbed)
    for k, v in model.state_dict().items():
        assert torch.equal(v, perturbed[k]), k
    stock.load_state_dict(perturbed)
    x = lm_batch()[0] if factory is not user_mlp else torch.randn(2, 3, 13)
    model.eval(), stock.eval()
    torch.testing.assert_close(model(x), stock(x), rtol=1e-4, atol=1e-5)


def test_missing_keys_are_reported_for_fused_modules():
    model, _, _, _ = fused_and_stock(HFModel, torch.float32)
    sd = model.state_dict()
    del sd["layers.0.self_attn.k_proj.weight"], sd["layers.1.mlp.up_proj.weight"]
    result = model.load_state_dict(sd, strict=False)
    assert set(result.missing_keys) == {"layers.0.self_attn.k_proj.weight", "layers.1.mlp.up_proj.weight"}


def test_broken_fused_site_is_rolled_back(monkeypatch):
    original = FusedLinearAct.forward
    monkeypatch.setattr(FusedLinearAct, "forward", lambda self, x: original(self, x) + 1e-2)
    model = user_mlp()
    report = fuse(model)
    rolled = {s.path: s.reason for s in report.rolled_back}
    assert set(rolled) == {"0", "4"} and all("verification failed" in r for r in rolled.values())
    assert [s.path for s in report.fused] == ["2"]  # the LayerNorm+GELU site is unaffected
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.ReLU
    assert "rolled back" in str(report)


def test_site_whose_forward_cannot_run_on_a_sample_is_rolled_back():
    class OddMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.proj = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)

        def forward(self, x, scale):  # needs an argument the verifier cannot guess
            return self.proj(self.act(self.fc(x))) * scale

    holder = nn.Module()
    holder.mlp = OddMLP()
    report = fuse(holder)
    assert not report.fused and "could not run" in report.rolled_back[0].reason
    assert type(holder.mlp.fc) is nn.Linear


def test_mlp_that_is_not_swiglu_is_rolled_back():
    class GeluGated(HFMLP):
        def forward(self, x):
            return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))

    holder = nn.Module()
    holder.mlp = GeluGated()
    report = fuse(holder, patterns=("swiglu",))
    assert [s.pattern for s in report.rolled_back] == ["swiglu"] and type(holder.mlp) is GeluGated


def test_cross_attention_inputs_stay_correct():
    attn = HFAttention()
    holder = nn.Module()
    holder.attn = attn
    stock = copy.deepcopy(attn)
    fuse(holder, patterns=("qkv",))
    x, memory = torch.randn(2, 5, DIM), torch.randn(2, 7, DIM)
    for fused_out, stock_out in [(attn.q_proj(x), stock.q_proj(x)), (attn.k_proj(memory), stock.k_proj(memory)),
                                 (attn.v_proj(memory), stock.v_proj(memory)), (attn.k_proj(x), stock.k_proj(x))]:
        torch.testing.assert_close(fused_out, stock_out)


def test_tied_or_hooked_sites_are_reported_not_fused():
    holder = nn.Module()
    holder.attn = HFAttention()
    holder.attn.k_proj.register_forward_hook(lambda m, i, o: None)
    report = fuse(holder, patterns=("qkv",))
    assert "hooks" in report.rolled_back[0].reason


@pytest.mark.parametrize("by", ["names", "data flow"])
def test_sites_whose_weights_disagree_on_requires_grad_are_not_concatenated(by):
    model = HFModel(layers=1)
    layer = model.layers[0]
    layer.self_attn.k_proj.weight.requires_grad_(False)  # k frozen, q and v trained
    layer.mlp.up_proj.weight.requires_grad_(False)  # up frozen, gate trained
    example = ((lm_batch()[0],), {}) if by == "data flow" else None
    report = fuse(model, patterns=("qkv", "swiglu"), example=example)
    assert not report.fused
    assert sorted(s.pattern for s in report.rolled_back) == ["qkv", "swiglu"]
    assert all("frozen" in s.reason for s in report.rolled_back)
    assert type(layer.self_attn.k_proj) is nn.Linear and type(layer.mlp) is HFMLP


def test_a_fused_swiglu_keeps_its_frozen_biases_frozen():
    from turbotrain.fusion.modules import FusedSwiGLUMLP

    gate, up, down = nn.Linear(DIM, 24), nn.Linear(DIM, 24), nn.Linear(24, DIM)
    for lin in (gate, up):
        lin.bias.requires_grad_(False)
    fused = FusedSwiGLUMLP(gate, up, down)
    assert fused.gate_up_weight.requires_grad and not fused.gate_up_bias.requires_grad


def test_bind_optimizer_repoints_the_same_object_at_fused_parameters():
    from turbotrain.optim_layout import bind_optimizer
    from turbotrain.plan import ModelPlan

    torch.manual_seed(0)
    model = HFModel()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    report = fuse(model)
    plan = ModelPlan(fused_from=report.param_map)
    assert bind_optimizer(opt, plan, model) is opt
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    assert opt.defaults["lr"] == 3e-3 and opt.param_groups[0]["weight_decay"] == 0.05
    idx, targets = lm_batch()
    cross_entropy_loss(model(idx), targets).backward()
    opt.step()
    with pytest.raises(ConfigError, match="factory"):
        fresh = HFModel()
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        for p in fresh.parameters():
            p.grad = torch.zeros_like(p)
        fresh_opt.step()  # it now holds momentum state
        bind_optimizer(fresh_opt, ModelPlan(fused_from=fuse(fresh).param_map), fresh)


def test_bind_optimizer_refuses_split_groups():
    from turbotrain.optim_layout import bind_optimizer
    from turbotrain.plan import ModelPlan

    model = HFModel(layers=1)
    attn = model.layers[0].self_attn
    rest = [p for n, p in model.named_parameters() if "k_proj" not in n]
    opt = torch.optim.SGD([{"params": rest}, {"params": [attn.k_proj.weight], "lr": 0.5}], lr=0.1)
    report = fuse(model, patterns=("qkv",))
    with pytest.raises(ConfigError, match="groups"):
        bind_optimizer(opt, ModelPlan(fused_from=report.param_map), model)


def test_unknown_pattern_is_a_config_error():
    with pytest.raises(ConfigError, match="linear_act"):
        fuse(nn.Linear(2, 2), patterns=("conv_bn",))


def test_report_lists_errors_and_renders():
    report = fuse(user_mlp())
    assert isinstance(report, FusionReport) and all(s.max_abs_error for s in report.fused)
    assert all(math.isfinite(s.min_sqnr_db) or s.min_sqnr_db == math.inf for s in report.fused)
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(report)
    assert "linear_act" in console.export_text()


def test_fuse_true_resolves_to_the_patterns_that_pay_on_each_device():
    """Config(fuse=True): every pattern for an eager step on a GPU (the Triton kernels), the loss head
    alone on a CPU and under compile, saying what it left out; a tuple is taken as given."""
    import doctest

    from turbotrain.config import FUSION_PATTERNS
    from turbotrain.fusion import transform
    from turbotrain.fusion.transform import patterns_for

    assert doctest.testmod(transform).failed == 0
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert patterns_for(True, cuda, compiled=False) == (FUSION_PATTERNS, None)
    for device, compiled, where in ((cuda, True, "under torch.compile"), (cpu, True, "under torch.compile"),
                                    (cpu, False, "on a CPU")):
        patterns, left_out = patterns_for(True, device, compiled)
        assert patterns == ("linear_cross_entropy",)
        assert left_out.startswith(f"fuse=True {where}: linear_cross_entropy only") and "fuse='all'" in left_out
    assert patterns_for(FUSION_PATTERNS, cpu, compiled=True) == (FUSION_PATTERNS, None)


def test_fuse_leaves_no_cycle_holding_the_probed_activations():
    """The probe's record (every module's inputs and outputs, with their autograd graphs) is a
    reference cycle; fuse() breaks it, so the activations go when fuse() returns, not whenever the
    cyclic collector next runs (on HF Llama at the ladder's shape they were ~540 MB, held through
    training)."""
    import gc

    from turbotrain.fusion.probe import Call

    model = HFModel(layers=2)
    gc.collect()
    gc.disable()
    try:
        report = fuse(model, patterns=("qkv", "swiglu"), example=example_for(HFModel))
        left = [o for o in gc.get_objects() if type(o) is Call]
    finally:
        gc.enable()
    assert {s.pattern for s in report.fused} == {"qkv", "swiglu"}
    assert left == []
