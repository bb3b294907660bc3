"""Plain-PyTorch attention (fusion/attention.py) against the stock scaled_dot_product_attention:
outputs and q/k/v gradients, in eager and through torch.compile, on user-gpt and HF Llama."""

import contextlib
import copy
import doctest
import logging

import pytest
import torch
import torch.nn.functional as F

from turbotrain import Config, Engine
from turbotrain.fusion import attention
from turbotrain.fusion.attention import PlainAttentionMode, plain_attention
from turbotrain.utils import sqnr_db

# (dtype, check): the tolerance next to the dtype it belongs to. The oracle is the stock op in fp64.
DTYPES = [
    # fp32: the same math in another order (blocks, FP32 softmax either way).
    pytest.param(torch.float32, ("rel", 1e-5), id="fp32"),
    # bf16: q kᵀ is rounded to bf16 before the FP32 softmax and the probabilities before @ v, one
    # rounding each (~48 dB alone); the stock CPU kernel keeps FP32 scores, so allow a few roundings.
    pytest.param(torch.bfloat16, ("sqnr", 30.0), id="bf16"),
]

# name -> (q shape, kv heads, kv length, sdpa keyword arguments (mask built per case), block)
CASES = {
    "causal-blocks": ((2, 4, 37, 16), 4, 37, {"is_causal": True}, 8),  # odd length: a short last block
    "causal-one-block": ((2, 4, 37, 16), 4, 37, {"is_causal": True}, None),
    "causal-longer-keys": ((1, 2, 9, 8), 2, 21, {"is_causal": True}, 4),  # sdpa aligns the mask top-left
    "causal-gqa-scale": ((2, 6, 20, 8), 2, 20, {"is_causal": True, "enable_gqa": True, "scale": 0.3}, 8),
    "bool-mask": ((2, 4, 13, 8), 4, 17, {"mask": "bool"}, 8),
    "float-mask": ((2, 4, 13, 8), 4, 17, {"mask": "float"}, 8),
    "no-mask": ((3, 13, 8), 3, 11, {}, 8),  # 3-d inputs: sdpa takes any leading dims
}


def make_case(name, dtype):
    shape, kv_heads, kv_len, kwargs, block = CASES[name]
    g = torch.Generator().manual_seed(0)
    kv_shape = (*shape[:-3], kv_heads, kv_len, shape[-1]) if len(shape) == 4 else (shape[0], kv_len, shape[-1])
    leaves = [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in (shape, kv_shape, kv_shape)]
    kwargs = dict(kwargs)
    mask = kwargs.pop("mask", None)
    if mask is not None:
        keep = torch.rand(shape[-2], kv_len, generator=g) > 0.4
        keep[3] = False  # a row with every key masked: 0 out, as the stock op gives, never NaN
        kwargs["attn_mask"] = keep if mask == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    return leaves, kwargs, block


def run(fn, leaves, upstream):
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, upstream.to(out.dtype))]


def check(actual, oracle, tol):
    kind, value = tol
    actual, oracle = actual.double(), oracle.double()
    assert torch.isfinite(actual).all()
    if kind == "rel":
        err = (actual - oracle).abs().max().item()
        assert err <= value * oracle.abs().max().item() + 1e-12, f"max error {err}"
    else:
        assert sqnr_db(oracle, actual) >= value, f"sqnr {sqnr_db(oracle, actual):.1f} dB"


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_plain_attention_matches_the_stock_op(case, dtype, tol):
    leaves, kwargs, block = make_case(case, dtype)
    oracle_leaves = [t.detach().double().requires_grad_() for t in leaves]
    oracle_kwargs = {k: (v.double() if k == "attn_mask" and v.is_floating_point() else v) for k, v in kwargs.items()}
    probe = plain_attention(*leaves, **kwargs)
    upstream = torch.randn(probe.shape, generator=torch.Generator().manual_seed(1))
    oracle = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **oracle_kwargs), oracle_leaves, upstream)
    plain = run(lambda q, k, v: plain_attention(q, k, v, block=block, **kwargs), leaves, upstream)
    for p, o in zip(plain, oracle):
        check(p, torch.nan_to_num(o), tol)
    if "attn_mask" in kwargs:  # the fully masked row, exactly as the stock op's math
        assert (plain[0][..., 3, :] == 0).all()


def test_the_mode_routes_sdpa_calls_and_leaves_dropout_to_the_stock_op(caplog):
    (q, k, v), _, _ = make_case("causal-blocks", torch.float32)
    mode = PlainAttentionMode(block=8)
    with mode:
        routed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert mode.calls == 1
    torch.testing.assert_close(routed, plain_attention(q, k, v, is_causal=True, block=8))
    torch.manual_seed(3)
    stock = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    with caplog.at_level(logging.WARNING, logger="turbotrain.fusion.attention"), mode:
        dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert mode.calls == 1 and torch.equal(dropped, stock)
    assert "dropout_p=0.5" in caplog.text


class Graphs:
    """A torch.compile backend that keeps every FX graph Dynamo hands it."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [n.target for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


def test_torch_compile_traces_through_the_mode_in_one_graph():
    torch._dynamo.reset()
    (q, k, v), _, _ = make_case("causal-gqa-scale", torch.bfloat16)
    backend = Graphs()

    def attend(q, k, v):
        with PlainAttentionMode(block=8):  # entered inside the compiled function, as CompileTransform does
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)

    out = torch.compile(attend, backend=backend, fullgraph=True)(q, k, v)  # fullgraph: a break would raise
    assert len(backend.graphs) == 1
    assert F.scaled_dot_product_attention not in backend.targets() and torch.matmul in backend.targets()
    torch.testing.assert_close(out, plain_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3, block=8))


MHA_CASES = {  # name -> (routed to plain attention, the call)
    "causal": (True, lambda m, x, c, b: m(x, x, x, attn_mask=c, need_weights=False, is_causal=True)[0]),
    "bool-mask": (True, lambda m, x, c, b: m(x, x, x, attn_mask=b, need_weights=False)[0]),
    "float-mask": (True, lambda m, x, c, b: m(x, x, x, attn_mask=c, need_weights=False)[0]),
    "no-mask": (True, lambda m, x, c, b: m(x, x, x, need_weights=False)[0]),
    "encoder-layer": (True, lambda m, x, c, b: m.layer(x, src_mask=c, is_causal=True)),
    "key-padding-mask": (False, lambda m, x, c, b: m(x, x, x, key_padding_mask=b[:2], need_weights=False)[0]),
    "need-weights": (False, lambda m, x, c, b: m(x, x, x, attn_mask=c)[0]),
    "cross-attention": (False, lambda m, x, c, b: m(x, x.flip(1), x.flip(1), need_weights=False)[0]),
}


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention_routes_its_own_sdpa_call_eagerly_and_under_compile(case):
    """nn.MultiheadAttention calls sdpa inside F.multi_head_attention_forward, past the mode; the mode
    takes that function's common training case itself (Dynamo kept the whole function as one opaque
    call before), with the stock outputs and gradients, and leaves every other case to it."""
    routed, call = MHA_CASES[case]
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    module.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
    x = torch.randn(2, 16, 32, requires_grad=True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(16)
    masked_out = torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) > 0.7
    masked_out[:, 0] = False
    params = [x, *module.parameters()]

    def outputs(mode=None):
        with mode or contextlib.nullcontext():
            out = call(module, x, causal, masked_out)
        return [out, *torch.autograd.grad(out.square().sum(), params, allow_unused=True)]

    stock = outputs()
    mode = PlainAttentionMode(block=8)
    plain = outputs(mode)
    assert mode.calls == routed
    for a, b in zip(plain, stock):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    torch._dynamo.reset()
    backend = Graphs()

    def step(x):
        with mode:
            return call(module, x, causal, masked_out)

    compiled = torch.compile(step, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(compiled, stock[0], rtol=1e-5, atol=1e-5)
    assert (F.multi_head_attention_forward not in backend.targets()) is routed
    assert (torch.matmul in backend.targets()) is routed


def loss_and_grads(model, loss_of, mode=None):
    model.zero_grad(set_to_none=True)
    if mode is None:
        loss = loss_of(model)
    else:
        with mode:
            loss = loss_of(model)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def compare_models(model, loss_of, calls, tol=("sqnr", 30.0)):
    """The model's loss and every weight grad, plain attention vs stock, both in bf16."""
    stock_loss, stock_grads = loss_and_grads(model, loss_of)
    mode = PlainAttentionMode(block=8)
    plain_loss, plain_grads = loss_and_grads(model, loss_of, mode)
    assert mode.calls == calls
    torch.testing.assert_close(plain_loss, stock_loss, rtol=1e-2, atol=0)
    assert stock_grads.keys() == plain_grads.keys()
    largest = max(float(g.float().norm()) for g in stock_grads.values())
    for name, grad in stock_grads.items():
        if float(grad.float().norm()) < 1e-3 * largest:
            # zero but for rounding (the key bias: softmax ignores a shift shared by a row's scores),
            # so there is no signal to take a ratio to; both must stay as small
            assert float(plain_grads[name].float().norm()) < 1e-3 * largest, name
        else:
            assert sqnr_db(grad, plain_grads[name]) >= tol[1], name


def test_user_gpt_loss_and_grads_match_with_plain_attention():
    from turbotrain.workloads import get_workload

    wl = get_workload("user-gpt", d=64, n_layer=2, n_head=4, T=32, B=2)
    model = wl.build_model().to(torch.bfloat16)
    tokens, targets = torch.randint(0, 8192, (2, 2, 32), generator=torch.Generator().manual_seed(0))
    compare_models(model, lambda m: wl.loss_fn(m(tokens).float(), targets), calls=2)


@pytest.mark.parametrize("padded", [False, True], ids=["is_causal", "padding-mask"])
def test_hf_llama_loss_and_grads_match_with_plain_attention(padded):
    hf = pytest.importorskip("hf_models")
    model = hf.build("llama").to(torch.bfloat16)  # 4 query heads on 2 key/value heads: GQA
    assert model.config._attn_implementation == "sdpa"
    batch = hf.batches("llama", 1)[0]
    if not padded:
        batch = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    compare_models(model, lambda m: m(**batch).loss, calls=model.config.num_hidden_layers)


@pytest.mark.slow  # two whole-model compiles: about two minutes on 2 cores
def test_engine_compiles_plain_attention_on_a_bf16_cpu_and_matches_stock():
    from turbotrain.workloads import get_workload

    wl = get_workload("user-gpt", d=64, n_layer=1, n_head=4, T=32, B=2)
    data = [torch.randint(0, 8192, (2, 2, 32), generator=torch.Generator().manual_seed(i)).unbind(0)
            for i in range(3)]
    base = wl.build_model()
    losses = {}
    for choice in ("auto", "stock"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), wl.loss_fn,
                        config=Config(precision="bf16-master", fuse=("linear_cross_entropy",), compile=True,
                                      device="cpu", attention=choice))
        losses[choice] = torch.stack([engine.step(b).loss for b in data]).float()
        compile_t = engine._transform("compile")
        assert compile_t.attention is (choice == "auto")  # auto: plain attention on a CPU in bf16
        assert ("plain attention" in compile_t.describe()) is (choice == "auto")
        assert engine.step(data[0]).recompiles == 0
    torch.testing.assert_close(losses["auto"], losses["stock"], rtol=1e-2, atol=0)


def test_docstring_examples_run():
    assert doctest.testmod(attention).failed == 0


def test_unpadded_hf_masks_swaps_the_sdpa_mask_only_for_an_all_ones_mask(monkeypatch):
    masking_utils = pytest.importorskip("transformers.masking_utils")
    from turbotrain.fusion.compile import unpadded_hf_masks

    registry = masking_utils.AttentionMaskInterface._global_mapping
    stock = registry["sdpa"]
    ids = torch.zeros(2, 6, dtype=torch.long)
    with unpadded_hf_masks({"input_ids": ids, "attention_mask": torch.ones(2, 6, dtype=torch.long)}):
        swapped = registry["sdpa"]
        assert swapped is not stock
        exact = dict(batch_size=2, q_length=6, kv_length=6, mask_function=masking_utils.causal_mask_function,
                     attention_mask=torch.ones(2, 6, dtype=torch.long))
        assert swapped(**exact) is None  # sdpa's is_causal stands for it
        window = masking_utils.and_masks(masking_utils.causal_mask_function,
                                         masking_utils.sliding_window_overlay(3))
        sliding = {**exact, "mask_function": window, "local_size": 3}  # as transformers asks for a sliding window
        built = swapped(**sliding)
        assert built is not None and torch.equal(built, stock(**sliding))
        wide = dict(sliding, local_size=6)  # a window as long as the sequence: built, as eager transformers does
        assert swapped(**wide) is not None and torch.equal(swapped(**wide), stock(**wide))
        assert swapped(**dict(sliding, local_size=7)) is None  # longer than the sequence: causal, as eager skips it
        # another thread's eager model with a padded batch, while the registry is swapped: its own mask
        theirs = dict(exact, attention_mask=torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]]))
        assert swapped(**theirs) is not None and torch.equal(swapped(**theirs), stock(**theirs))
    assert registry["sdpa"] is stock
    from turbotrain.fusion.compile import _causal_skipping

    skip = _causal_skipping(lambda *args, **kw: "built by transformers")
    assert skip(**exact) == "built by transformers"  # eager (another thread, a graph break): transformers decides
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as while Dynamo traces the model
    assert skip(**exact) is None and skip(**dict(sliding, local_size=7)) is None
    for request in (dict(exact, allow_is_causal_skip=False),  # extra mask functions, packing, bidirectional
                    dict(exact, q_length=1),  # one query against six keys
                    dict(exact, q_offset=2, kv_offset=2),
                    dict(exact, q_offset=torch.tensor(0)),  # a static cache's offset is not read
                    wide):
        assert skip(**request) == "built by transformers"
    assert registry["sdpa"] is stock
    padded = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    with unpadded_hf_masks({"input_ids": ids, "attention_mask": padded}):
        assert registry["sdpa"] is stock
    with unpadded_hf_masks({"input_ids": ids}):  # no mask: transformers decides (packed sequences, ...)
        assert registry["sdpa"] is stock
    ones = torch.ones(2, 6, dtype=torch.long)
    with unpadded_hf_masks({"input_ids": ids, "attention_mask": ones, "decoder_attention_mask": padded}):
        assert registry["sdpa"] is stock  # the decoder's causal mask needs its padding
    for unpadded in (ones, None):  # None: the decoder's mask is causal alone
        with unpadded_hf_masks({"input_ids": ids, "attention_mask": ones, "decoder_attention_mask": unpadded}):
            assert registry["sdpa"] is not stock


def compiled_attention_calls(model, batch, monkeypatch):
    """One compiled Engine step of an HF ``model`` on ``batch`` with a spy on plain attention:
    ({(no mask, is_causal)} over its calls, the step's loss, the model's own loss eagerly)."""
    with torch.no_grad():
        expected = model(**batch).loss
    calls = []
    plain = attention.plain_attention

    def spy(query, key, value, attn_mask=None, is_causal=False, *args):
        calls.append((attn_mask is None, is_causal))  # at trace time: once per layer
        return plain(query, key, value, attn_mask, is_causal, *args)

    monkeypatch.setattr(attention, "plain_attention", spy)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), config=Config(
        device="cpu", compile=True, attention="plain"))
    loss = engine.step(batch).loss
    assert calls
    return set(calls), loss, expected


@pytest.mark.parametrize("padded", [False, True], ids=["all-ones-mask", "padding-mask"])
def test_compiled_hf_model_attends_causally_without_padding(padded, monkeypatch):
    """Under torch.compile transformers (torch < 2.14) materialises a 4-d causal mask from any mask,
    in training (no cache) even without one; on an unpadded batch the Engine keeps sdpa's is_causal
    path, as transformers takes eagerly, with the same loss."""
    hf = pytest.importorskip("hf_models")
    torch._dynamo.reset()
    model = hf.build("llama")
    model.config.use_cache = False  # training: no cache
    batch = hf.batches("llama", 1)[0]
    if not padded:
        batch = {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["input_ids"]),
                 "labels": batch["input_ids"]}
    calls, loss, expected = compiled_attention_calls(model, batch, monkeypatch)
    assert calls == ({(False, False)} if padded else {(True, True)})
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("window", [64, 8], ids=["window-longer-than-the-sequence", "window-shorter"])
def test_compiled_sliding_window_model_attends_causally_when_the_window_masks_nothing(window, monkeypatch):
    """Mistral's window (4096 by default) longer than the sequence
    masks nothing beyond the causal triangle: eager transformers then asks sdpa for is_causal, and
    so does the compiled Engine on an unpadded batch; a shorter window is built and passed as a mask."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=64, sliding_window=window, use_cache=False))
    ids = torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    calls, loss, expected = compiled_attention_calls(model, batch, monkeypatch)
    assert calls == ({(True, True)} if window > 24 else {(False, False)})
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)


class DropoutAttention(torch.nn.Module):
    """Attention dropout, which only the stock kernel has: compiled plain attention must say it left it."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 96), torch.nn.Linear(32, 64)

    def forward(self, ids):
        q, k, v = self.qkv(self.emb(ids)).view(*ids.shape, 3, 4, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return self.head(out.transpose(1, 2).flatten(2))


def test_compiled_attention_left_to_the_stock_kernel_is_said_once_and_described(caplog):
    torch._dynamo.reset()
    attention._WARNED.clear()
    torch.manual_seed(0)
    engine = Engine(DropoutAttention(), lambda p: torch.optim.SGD(p, lr=0.1),
                    lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten()),
                    config=Config(device="cpu", precision="bf16-master", compile=True, attention="plain"))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="turbotrain.fusion.attention"):
        recompiles = [engine.step((ids, ids)).recompiles for _ in range(3)]
    assert recompiles == [0, 0, 0]  # noting it must not make Dynamo guard on the notes
    said = [r.getMessage() for r in caplog.records if "stock kernel" in r.getMessage()]
    assert len(said) == 1 and "dropout_p=0.1" in said[0], said
    assert "left to the stock kernel: dropout_p=0.1" in engine.describe()
