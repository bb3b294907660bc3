"""Each fused op against its plain-PyTorch reference twin: output, input grad and weight grads."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from turbotrain.errors import FusionError
from turbotrain.fusion import (bias_dropout_residual, bias_dropout_residual_reference, fused_adamw,
                               layernorm_act, layernorm_act_reference, linear_act, linear_act_reference,
                               linear_cross_entropy, linear_cross_entropy_reference, qkv_projection,
                               qkv_projection_reference, sqnr, swiglu_mlp, swiglu_mlp_reference)

# (dtype, check) pairs: the tolerance sits next to the dtype it belongs to.
DTYPES = [
    # fp32: both sides compute in fp32; only summation order differs (fused bias-grad, chunking).
    pytest.param(torch.float32, {"rel": 1e-4}, id="fp32"),
    # bf16: the fused ops keep fp32 between GEMM and epilogue where stock rounds to bf16, so the two
    # differ by a few bf16 roundings; compared against an fp32 oracle, fused must be >= 30 dB.
    pytest.param(torch.bfloat16, {"sqnr": 30.0}, id="bf16"),
]
SHAPES = [(4, 16, 32), (5, 123, 123)]  # (batch, seq, features); the second is deliberately odd


def check(test, oracle, tol):
    test, oracle = test.double().cpu(), oracle.double().cpu()
    if "rel" in tol:
        err = (test - oracle).abs().max().item()
        assert err <= tol["rel"] * oracle.abs().max().item() + 1e-12, f"max error {err}"
    else:
        assert sqnr(oracle, test) >= tol["sqnr"], f"sqnr {sqnr(oracle, test):.1f} dB"


def leaves(dtype, *shapes, scale=1.0):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*s, generator=g) * scale).to(dtype).requires_grad_() for s in shapes]


def run(fn, inputs, upstream=None):
    out = fn(*inputs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) if upstream is None else upstream
    upstream = upstream.to(out.device, out.dtype)
    return out, torch.autograd.grad(out, [t for t in inputs if t.requires_grad], upstream)


def compare(fused, reference, inputs, tol):
    """Fused in ``dtype`` (on the inputs' device) vs the reference in fp32 on the CPU, same inputs."""
    out, grads = run(fused, inputs)
    oracle_inputs = [t.detach().float().cpu().requires_grad_() for t in inputs]
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = run(reference, oracle_inputs, upstream)
    check(out, ref, tol)
    for g, r in zip(grads, ref_grads):
        check(g, r, tol)


# Every activation in fp32; bf16 for two of them (each variant costs a kernel compile).
LINEAR_ACT_CASES = [(d, a) for d in DTYPES[:1] for a in ("relu", "gelu", "gelu_tanh", "silu")] + [
    (DTYPES[1], "gelu"), (DTYPES[1], "silu")]


@pytest.mark.parametrize("dtype_tol,act", LINEAR_ACT_CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_act(dtype_tol, shape, act):
    dtype, tol = dtype_tol.values
    b, t, d = shape
    inputs = leaves(dtype, (b, t, d), (d + 7, d), (d + 7,), scale=0.5)
    compare(lambda x, w, bias: linear_act(x, w, bias, act),
            lambda x, w, bias: linear_act_reference(x, w, bias, act), inputs, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", ["gelu"])
def test_layernorm_act(dtype, tol, shape, act):
    b, t, d = shape
    x, w, bias = leaves(dtype, (b, t, d), (d,), (d,))
    compare(lambda x, w, bias: layernorm_act(x, w, bias, 1e-5, act),
            lambda x, w, bias: layernorm_act_reference(x, w, bias, 1e-5, act), [x * 3 + 1, w, bias], tol)


def test_layernorm_act_without_affine():
    (x,) = leaves(torch.float32, (3, 7, 19))
    compare(lambda x: layernorm_act(x, None, None), lambda x: layernorm_act_reference(x, None, None),
            [x], {"rel": 1e-4})


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_qkv_projection_gqa_sizes(dtype, tol, shape):
    b, t, d = shape
    sizes = (d, d // 4, d // 4)  # grouped-query attention: smaller k and v
    x, wq, wk, wv, bq, bk, bv = leaves(dtype, (b, t, d), (sizes[0], d), (sizes[1], d), (sizes[2], d),
                                       (sizes[0],), (sizes[1],), (sizes[2],), scale=0.3)
    fused = lambda x, wq, wk, wv, bq, bk, bv: torch.cat(  # noqa: E731
        qkv_projection(x, torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv]), sizes), -1)
    ref = lambda x, wq, wk, wv, bq, bk, bv: torch.cat(  # noqa: E731
        qkv_projection_reference(x, (wq, wk, wv), (bq, bk, bv)), -1)
    compare(fused, ref, [x, wq, wk, wv, bq, bk, bv], tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_mlp(dtype, tol, shape):
    b, t, d = shape
    h = 2 * d + 3
    x, wg, wu, wd = leaves(dtype, (b, t, d), (h, d), (h, d), (d, h), scale=0.2)
    compare(lambda x, wg, wu, wd: swiglu_mlp(x, torch.cat([wg, wu]), wd), swiglu_mlp_reference,
            [x, wg, wu, wd], tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_bias_dropout_residual_with_given_mask(dtype, tol, p):
    x, bias, res = leaves(dtype, (5, 123, 123), (123,), (5, 123, 123))
    mask = torch.rand(5, 123, 123, generator=torch.Generator().manual_seed(4)) >= p
    compare(lambda x, b, r: bias_dropout_residual(x, b, r, p, mask=mask),
            lambda x, b, r: bias_dropout_residual_reference(x, b, r, p, mask=mask), [x, bias, res], tol)


def test_bias_dropout_residual_draws_a_fresh_mask_at_rate_p():
    x, res = torch.ones(64, 256, requires_grad=True), torch.zeros(64, 256)
    out = bias_dropout_residual(x, None, res, p=0.25)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.02  # 16k draws: 4 sigma is ~0.014
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / 0.75))
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(grad != 0, kept)  # the backward uses the very mask of the forward
    with pytest.raises(FusionError):
        bias_dropout_residual(x, None, res, p=1.0)


@pytest.mark.parametrize("dtype,tol", [
    pytest.param(torch.float32, {"rel": 1e-4}, id="fp32"),
    # bf16: logits are bf16 GEMM outputs (as the stock bf16 head); the lse and grads are fp32.
    pytest.param(torch.bfloat16, {"sqnr": 30.0}, id="bf16"),
])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 37])
def test_linear_cross_entropy(dtype, tol, with_bias, chunk_rows):
    h, w, b = leaves(dtype, (5, 123, 64), (500, 64), (500,), scale=0.5)
    targets = torch.randint(0, 500, (5, 123), generator=torch.Generator().manual_seed(2))
    targets[0, :50] = -100
    targets[3] = -100
    bias = b if with_bias else None
    inputs = [h, w] + ([b] if with_bias else [])
    fused = lambda h, w, *b: linear_cross_entropy(h, w, b[0] if b else None, targets, chunk_rows=chunk_rows)  # noqa: E731
    ref = lambda h, w, *b: linear_cross_entropy_reference(h, w, b[0] if b else None, targets)  # noqa: E731
    compare(fused, ref, inputs, tol)
    assert bias is None or bias.requires_grad


@pytest.mark.parametrize("dtype,tol", [
    pytest.param(torch.float32, {"rel": 1e-4}, id="fp32"),
    pytest.param(torch.bfloat16, {"sqnr": 30.0}, id="bf16"),
])
@pytest.mark.parametrize("smoothing, weighted", [(0.1, False), (0.0, True), (0.3, True)],
                         ids=["smoothing", "class-weights", "both"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_with_label_smoothing_and_class_weights(dtype, tol, smoothing, weighted, reduction):
    # F.cross_entropy's meaning: the smoothing spreads over every class, weighted by the class weights
    # where there are some, and a weighted mean divides by the kept targets' summed weights.
    h, w, b = leaves(dtype, (3, 57, 32), (300, 32), (300,), scale=0.5)
    g = torch.Generator().manual_seed(5)
    targets = torch.randint(0, 300, (3, 57), generator=g)
    targets[1, 10:] = -100
    weight = torch.rand(300, generator=g) * 2 + 0.1 if weighted else None
    settings = dict(reduction=reduction, label_smoothing=smoothing, class_weight=weight)
    fused = lambda h, w, b: linear_cross_entropy(h, w, b, targets, chunk_rows=40, **settings)  # noqa: E731
    ref = lambda h, w, b: linear_cross_entropy_reference(h, w, b, targets, **settings)  # noqa: E731
    compare(fused, ref, [h, w, b], tol)


def test_linear_cross_entropy_names_bad_smoothing_and_class_weights():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(FusionError, match="label_smoothing=1.5"):
        linear_cross_entropy(h, w, None, t, label_smoothing=1.5)
    with pytest.raises(FusionError, match="one weight per class"):
        linear_cross_entropy(h, w, None, t, class_weight=torch.ones(9))
    with pytest.raises(FusionError, match="requires grad"):
        linear_cross_entropy(h, w, None, t, class_weight=torch.ones(10, requires_grad=True))


def test_linear_cross_entropy_never_allocates_full_logits():
    rows, vocab, dim = 512, 4096, 32
    h = torch.randn(rows, dim, requires_grad=True)
    w = torch.randn(vocab, dim, requires_grad=True)
    t = torch.randint(0, vocab, (rows,))
    full_logits = rows * vocab * 4
    biggest = []

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor):
                    biggest.append(o.numel() * o.element_size())
            return out

    with Watch():
        linear_cross_entropy(h, w, None, t, chunk_rows=64).backward()
    assert max(biggest) < full_logits / 4


def test_cross_entropy_chunk_rows_are_chosen_per_device():
    from turbotrain.fusion.ops.linear_cross_entropy import default_chunk_rows

    assert default_chunk_rows(16384, 8192, 512) == 512  # CPU: ~4M logits per chunk (measured)
    assert default_chunk_rows(16384, 2048, 512) == 2048
    assert default_chunk_rows(16384, 50257, 768) == 512  # the CPU floor: 64-row chunks ran 1.65x slower
    assert default_chunk_rows(300, 50257, 768) == 300
    assert default_chunk_rows(16384, 50257, 4096, "cuda") == 2048  # CUDA: ~128M logits (reasoned)
    assert default_chunk_rows(16384, 128256, 4096, "cuda") == 1024  # the CUDA floor
    assert default_chunk_rows(100, 50257, 4096, "cuda") == 100  # never more rows than there are


def test_linear_cross_entropy_rejects_mismatched_targets():
    with pytest.raises(FusionError, match="targets"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), None, torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("bad", [10, -5])
def test_linear_cross_entropy_names_an_out_of_range_target(bad):
    targets = torch.tensor([1, -100, bad, 3])
    with pytest.raises(FusionError, match=f"target {bad} is outside the vocabulary"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), None, targets)


@pytest.mark.parametrize("targets", [[1, -1, 3, -1, 0, 7], [-1] * 6], ids=["some-ignored", "all-ignored"])
def test_linear_cross_entropy_sums_as_f_cross_entropy_does(targets):
    # reduction='sum': every target ignored gives 0 with zero gradients (as torch does), not 0 * NaN
    targets = torch.tensor(targets)
    g = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(*shape, generator=g, requires_grad=True) for shape in ((6, 8), (10, 8), (10,)))
    loss = linear_cross_entropy(h, w, b, targets, ignore_index=-1, chunk_rows=4, reduction="sum")
    grads = torch.autograd.grad(loss, (h, w, b))
    ref = F.cross_entropy(F.linear(h, w, b), targets, ignore_index=-1, reduction="sum")
    ref_grads = torch.autograd.grad(ref, (h, w, b))
    torch.testing.assert_close(loss, ref)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    with pytest.raises(FusionError, match="reduction='none'"):
        linear_cross_entropy(h, w, b, targets, reduction="none")


def check_fp16_loss_scale(device, chunk_rows=None, rows=512, vocab=1000, dim=64, scale=2.0**16):
    """fp16 training multiplies the loss by 2**16 (inf in fp16) so that gradients like
    softmax/n_valid do not underflow. The fused op must scale in FP32 and round once, giving
    finite grads as accurate as the stock fp16 head (F.linear in fp16, CE on FP32 logits)."""
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(rows, dim, generator=g) * 0.5, torch.randn(vocab, dim, generator=g) * 0.5
    b = torch.randn(vocab, generator=g)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[:40] = -100

    def grads(fn, dtype, loss_scale, on):
        inputs = [t.detach().to(on, dtype).requires_grad_() for t in (h, w, b)]
        (fn(*inputs, targets.to(on)) * loss_scale).backward()
        return [t.grad.float().cpu() / loss_scale for t in inputs]

    oracle = grads(linear_cross_entropy_reference, torch.float32, 1.0, "cpu")
    stock = grads(linear_cross_entropy_reference, torch.float16, scale, device)
    fused = grads(lambda h, w, b, t: linear_cross_entropy(h, w, b, t, chunk_rows=chunk_rows), torch.float16,
                  scale, device)
    for name, o, s, f in zip(("hidden", "weight", "bias"), oracle, stock, fused):
        assert torch.isfinite(f).all(), f"{name} grad has inf/NaN"
        # fp16 rounding on both sides; the fused one rounds no more often than stock, so it may
        # not be more than 3 dB (a factor 1.4 in error) worse. Stock reaches ~67 dB on the CPU.
        assert sqnr(o, f) >= sqnr(o, s) - 3.0, f"{name}: fused {sqnr(o, f):.1f} dB, stock {sqnr(o, s):.1f} dB"


def test_linear_cross_entropy_fp16_survives_a_2_16_loss_scale(monkeypatch):
    monkeypatch.setenv("TURBOTRAIN_FUSION_KERNELS", "eager")  # the scaling under test is outside the epilogue
    check_fp16_loss_scale("cpu", chunk_rows=128)


def test_flop_counter_sees_fused_ops():
    m, k, n = 35, 13, 11
    x, w, b = leaves(torch.float32, (5, 7, k), (n, k), (n,))
    with FlopCounterMode(display=False) as counter:
        linear_act(x, w, b, "gelu").sum().backward()
    assert counter.get_total_flops() == 3 * 2 * m * k * n  # forward GEMM + dx and dW GEMMs
    with FlopCounterMode(display=False) as counter:
        linear_cross_entropy(x, torch.randn(50, k, requires_grad=True), None, torch.randint(0, 50, (5, 7)))
    assert counter.get_total_flops() == 3 * 2 * m * k * 50  # logits + both grads, all in the forward


def test_profiler_names_the_fused_op():
    x, w, b = leaves(torch.float32, (4, 8), (16, 8), (16,))
    with torch.profiler.profile() as prof:
        linear_act(x, w, b, "silu").sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert "turbotrain::linear_act" in names and "turbotrain::linear_act_backward" in names


def test_fused_adamw_is_fused_where_supported_and_steps_like_adamw():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    fused, stock = fused_adamw(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    assert fused.defaults["fused"]  # CPU has had a fused AdamW kernel since torch 2.4
    x = torch.randn(4, 8)
    for model, opt in ((a, fused), (b, stock)):
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fused_adamw_refuses_to_be_told_how():
    with pytest.raises(FusionError):
        fused_adamw(torch.nn.Linear(2, 2).parameters(), fused=False)
