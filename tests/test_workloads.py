"""The five workloads: registry and validation, model structure, determinism, and that each one
actually learns (its held-out loss falls under plain AdamW)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from turbotrain.errors import ConfigError, UnknownWorkloadError
from turbotrain.workloads import WORKLOADS, Workload, get_workload, load_corpus
from turbotrain.workloads.bert import mask_tokens
from turbotrain.workloads.data import split_generator
from turbotrain.workloads.gpt import SelfAttention
from turbotrain.workloads.llama import apply_rope

TEXT = dict(d=64, n_layer=1, n_head=4, T=32, B=8)
#: Tiny overrides, plus (learning rate, the least drop in val loss after 30 steps). The drops
#: are about half of what these runs reach, so they test a real learning signal with slack.
TINY = {
    "gpt": (TEXT, 3e-3, 1.0),  # 30 steps learn unigram/bigram statistics: ~9.0 -> ~7.0 nats
    "llama": (TEXT, 3e-3, 1.0),
    "bert": (TEXT, 3e-3, 0.5),  # only 15% of positions carry a target, so it learns slower
    "resnet": (dict(B=16, image_size=32, width=8, layers=(1, 1)), 1e-2, 0.3),
    "mlp": (dict(B=64, in_dim=32, hidden=64, n_layer=2), 1e-2, 0.5),
}


@pytest.fixture(scope="session", autouse=True)
def corpus():
    """Build (first run on a machine, ~15 s) or load the default corpus once per session."""
    return load_corpus()


def tiny(name: str) -> Workload:
    return get_workload(name, **TINY[name][0])


def take(stream, n):
    return [next(stream) for _ in range(n)]


# ----------------------------------------------------------------------------- registry


def test_registry_lists_all_five():
    assert WORKLOADS == ("gpt", "llama", "bert", "resnet", "mlp")


def test_unknown_workload_names_every_valid_one_on_one_line():
    with pytest.raises(UnknownWorkloadError) as info:
        get_workload("gpt5")
    message = str(info.value)
    assert "\n" not in message and "'gpt5'" in message
    assert all(name in message for name in WORKLOADS)
    assert isinstance(info.value, ConfigError)


def test_unknown_override_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"no setting 'width'.*d, n_layer, n_head, T, B"):
        get_workload("gpt", width=3)


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("gpt", dict(d="64"), "must be int"),
        ("gpt", dict(d=64.5), "must be int"),
        ("gpt", dict(B=True), "must be int"),
        ("gpt", dict(d=-8), "d=-8"),
        ("gpt", dict(d=96, n_head=5), "n_head=5 must divide d=96"),
        ("gpt", dict(vocab_size=100), "vocab_size=100"),
        ("llama", dict(d=24, n_head=8), "even head size"),
        ("bert", dict(mask_prob=0.0), "mask_prob"),
        ("resnet", dict(layers=()), "layers"),
        ("resnet", dict(layers=(1, 1, 1, 1, 1), image_size=32), "too small"),
        ("mlp", dict(act="tanh"), "'gelu', 'relu'"),
    ],
)
def test_bad_values_raise_config_error(name, overrides, match):
    with pytest.raises(ConfigError, match=match):
        get_workload(name, **overrides)


@pytest.mark.parametrize("name", WORKLOADS)
def test_settings_record_overrides_and_items_per_batch(name):
    wl = tiny(name)
    assert wl.name == name
    for key, value in TINY[name][0].items():
        assert wl.settings[key] == value
    x, _ = next(wl.batches())
    per_batch = x.numel() if wl.kind == "text" else x.shape[0]
    assert wl.items_per_batch == per_batch
    assert wl.unit == ("tokens" if wl.kind == "text" else "samples")


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", WORKLOADS)
def test_batches_deterministic_per_seed_and_distinct_across_seeds_and_splits(name):
    wl = tiny(name)
    a, b = take(wl.batches("train", seed=0), 2), take(wl.batches("train", seed=0), 2)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a[0][0], a[1][0])
    assert not torch.equal(a[0][0], next(wl.batches("train", seed=1))[0])
    assert not torch.equal(a[0][0], next(wl.batches("val", seed=0))[0])


@pytest.mark.parametrize("name", WORKLOADS)
def test_build_model_is_seeded_and_leaves_global_rng_alone(name):
    wl = tiny(name)
    torch.manual_seed(1)
    expected_draw = torch.rand(3)
    torch.manual_seed(1)
    first = wl.build_model().state_dict()
    assert torch.equal(torch.rand(3), expected_draw)  # the caller's RNG stream is unchanged
    torch.manual_seed(2)
    second = wl.build_model().state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = get_workload(name, **TINY[name][0], init_seed=7).build_model().state_dict()
    assert any(not torch.equal(first[k], other[k]) for k in first if first[k].is_floating_point())


# ----------------------------------------------------------------------------- forward/backward and learning


@pytest.mark.parametrize("name", WORKLOADS)
def test_forward_backward_reaches_every_parameter(name):
    wl = tiny(name)
    model = wl.build_model()
    x, y = next(wl.batches())
    out = model(x)
    if wl.kind == "text":
        assert out.shape == (*x.shape, wl.settings["vocab_size"])
    else:
        assert out.shape == (x.shape[0], wl.settings["num_classes"])
    loss = wl.loss_fn(out, y)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


def _val_loss(wl, model, batches):
    model.eval()
    with torch.no_grad():
        loss = sum(float(wl.loss_fn(model(x), y)) for x, y in batches) / len(batches)
    model.train()
    return loss


@pytest.mark.parametrize("name", WORKLOADS)
def test_loss_falls_on_held_out_batches_under_adamw(name):
    _, lr, min_drop = TINY[name]
    wl = tiny(name)
    model = wl.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    val = take(wl.batches("val"), 4)
    before = _val_loss(wl, model, val)
    for x, y in take(wl.batches("train"), 30):
        loss = wl.loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = _val_loss(wl, model, val)
    assert after < before - min_drop, (before, after)


def test_initial_loss_is_near_chance():
    """Small init gives uniform predictions, so the first loss is ~ln(classes): a check that
    the logits and the loss are wired to the right axis."""
    for name in WORKLOADS:
        wl = tiny(name)
        x, y = next(wl.batches())
        classes = wl.settings.get("vocab_size") or wl.settings["num_classes"]
        with torch.no_grad():
            loss = float(wl.loss_fn(wl.build_model()(x), y))
        assert abs(loss - math.log(classes)) < 0.5, (name, loss)


# ----------------------------------------------------------------------------- structure the passes rely on


def test_gpt_module_names():
    model = tiny("gpt").build_model()
    assert isinstance(model.blocks, nn.ModuleList)
    block = model.blocks[0]
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert isinstance(getattr(block.attn, proj), nn.Linear)
    assert isinstance(block.ln_1, nn.LayerNorm) and isinstance(block.ln_2, nn.LayerNorm)
    assert isinstance(model.ln_f, nn.LayerNorm)
    assert isinstance(block.mlp.fc, nn.Linear) and isinstance(block.mlp.act, nn.GELU)
    assert isinstance(model.lm_head, nn.Linear)


def test_llama_module_names():
    model = tiny("llama").build_model()
    block = model.blocks[0]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert getattr(block.attn, proj).bias is None
    assert isinstance(block.input_layernorm, nn.RMSNorm) and isinstance(model.norm, nn.RMSNorm)
    assert isinstance(block.mlp.act, nn.SiLU)
    assert block.mlp.gate_proj.out_features == block.mlp.up_proj.out_features == block.mlp.down_proj.in_features


def test_llama_default_mlp_hidden_is_llamas_rounding():
    assert get_workload("llama").settings["mlp_hidden"] == 1408  # ceil(8/3 * 512 / 64) * 64


@pytest.mark.parametrize("name, causal", [("gpt", True), ("llama", True), ("bert", False)])
def test_decoders_are_causal_and_the_encoder_is_not(name, causal):
    model = tiny(name).build_model().eval()
    x = next(tiny(name).batches())[0][:1]
    changed = x.clone()
    changed[0, -1] = (x[0, -1] + 1) % 512
    with torch.no_grad():
        early = (model(x)[0, :-1] - model(changed)[0, :-1]).abs().max()
    assert (early == 0) if causal else (early > 0)


# ----------------------------------------------------------------------------- reference twins


def reference_attention(q, k, v, causal):
    """Softmax attention written out: the oracle SDPA is compared against."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        t = q.shape[-2]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("causal", [True, False])
def test_self_attention_matches_written_out_softmax(causal):
    torch.manual_seed(0)
    attn = SelfAttention(48, 3, causal=causal)
    x = torch.randn(2, 13, 48)  # odd length, head size 16
    heads = lambda t: t.view(2, 13, 3, 16).transpose(1, 2)
    y = reference_attention(heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x)), causal)
    expected = attn.out_proj(y.transpose(1, 2).reshape(2, 13, 48))
    # fp32: SDPA's fused softmax sums in another order; 1e-5 covers that rounding.
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-5)


def reference_rope(x, theta):
    """RoPE as complex rotation of (x_i, x_{i+hd/2}) by position * theta^(-2i/hd)."""
    t, hd = x.shape[-2], x.shape[-1]
    freqs = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rot = torch.polar(torch.ones(t, hd // 2, dtype=torch.float64), torch.arange(t, dtype=torch.float64)[:, None] * freqs)
    z = torch.complex(x[..., : hd // 2].double(), x[..., hd // 2:].double()) * rot
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def test_rope_matches_complex_rotation_and_depends_on_relative_position_only():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, 8)
    # fp32 angles up to 16 rad: sin/cos rounding ~1e-6 relative, so 1e-5 absolute on unit data.
    torch.testing.assert_close(apply_rope(x, 10000.0), reference_rope(x, 10000.0), rtol=1e-5, atol=1e-5)
    q, k = torch.randn(1, 1, 1, 8).expand(1, 1, 17, 8), torch.randn(1, 1, 1, 8).expand(1, 1, 17, 8)
    dots = (apply_rope(q, 10000.0)[..., 5:, :] * apply_rope(k, 10000.0)[..., :-5, :]).sum(-1)
    torch.testing.assert_close(dots, dots[..., :1].expand_as(dots), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- masking


def test_bert_masking_follows_the_80_10_10_rule(corpus):
    window = corpus.train[:64 * 256].view(64, 256)
    inputs, targets = mask_tokens(window, corpus.mask_id, corpus.vocab_size, 0.15, split_generator(0, "train"))
    chosen = targets != -100
    assert torch.equal(targets[chosen], window[chosen])
    assert torch.equal(inputs[~chosen], window[~chosen])
    assert 0.13 < chosen.float().mean() < 0.17
    masked = (inputs[chosen] == corpus.mask_id).float().mean()
    assert 0.77 < masked < 0.83
    assert (inputs == corpus.mask_id).sum() == (inputs[chosen] == corpus.mask_id).sum()


def test_bert_batch_targets_only_at_masked_positions():
    wl = tiny("bert")
    x, y = next(wl.batches())
    assert x.shape == y.shape == (8, 32)
    assert 0 < (y != -100).sum() < y.numel()


def test_mask_never_leaves_a_batch_without_targets(corpus):
    window = corpus.train[:4].view(1, 4)
    for seed in range(20):
        _, targets = mask_tokens(window, corpus.mask_id, corpus.vocab_size, 0.01, split_generator(seed, "train"))
        assert (targets != -100).any()
