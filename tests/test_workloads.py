"""The workloads: registry and validation, model structure, determinism, and that each one actually
learns (its held-out loss falls under plain AdamW); the foreign ones (a user's GPT, Hugging Face
models with dict batches and their own loss) also train through the Engine and a peer row."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from turbotrain.errors import ConfigError, HardwareError, UnknownWorkloadError
from turbotrain.workloads import FOREIGN_WORKLOADS, NATIVE_WORKLOADS, WORKLOADS, Workload, get_workload, load_corpus
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
    "user-gpt": (TEXT, 3e-3, 1.0),
    "hf-llama": (TEXT, 3e-3, 1.0),
    "hf-gpt2": (TEXT, 3e-3, 1.0),
    "hf-bert": (TEXT, 3e-3, 0.5),
}
HF = ("hf-llama", "hf-gpt2", "hf-bert")


def _needs(name):
    """HF workloads skip where transformers (the [hf] extra) is not installed."""
    if name not in HF:
        return name
    try:
        import transformers  # noqa: F401
    except ImportError:
        return pytest.param(name, marks=pytest.mark.skip(reason="transformers not installed"))
    return name


ALL = [_needs(n) for n in WORKLOADS]


@pytest.fixture(scope="session", autouse=True)
def corpus():
    """Build (first run on a machine, ~15 s) or load the default corpus once per session."""
    return load_corpus()


def tiny(name: str) -> Workload:
    return get_workload(name, **TINY[name][0])


def take(stream, n):
    return [next(stream) for _ in range(n)]


def tokens(batch) -> torch.Tensor:
    """The model input of a batch: a pair's first tensor, a dict's input_ids."""
    return batch["input_ids"] if isinstance(batch, dict) else batch[0]


def logits(model, batch) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, dict) else model(batch[0])
    return out.logits if isinstance(batch, dict) else out


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- registry


def test_registry_lists_native_then_foreign():
    assert NATIVE_WORKLOADS == ("gpt", "llama", "bert", "resnet", "mlp")
    assert FOREIGN_WORKLOADS == ("user-gpt", "hf-llama", "hf-gpt2", "hf-bert")
    assert WORKLOADS == NATIVE_WORKLOADS + FOREIGN_WORKLOADS


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
        ("user-gpt", dict(d=96, n_head=5), "n_head=5 must divide d=96"),
        ("hf-bert", dict(mask_prob=1.5), "mask_prob"),
    ],
)
def test_bad_values_raise_config_error(name, overrides, match):
    with pytest.raises(ConfigError, match=match):
        get_workload(name, **overrides)


@pytest.mark.parametrize("name", ALL)
def test_settings_record_overrides_and_items_per_batch(name):
    wl = tiny(name)
    assert wl.name == name
    for key, value in TINY[name][0].items():
        assert wl.settings[key] == value
    x = tokens(next(wl.batches()))
    per_batch = x.numel() if wl.kind == "text" else x.shape[0]
    assert wl.items_per_batch == per_batch
    assert wl.unit == ("tokens" if wl.kind == "text" else "samples")


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", ALL)
def test_batches_deterministic_per_seed_and_distinct_across_seeds_and_splits(name):
    wl = tiny(name)
    a, b = take(wl.batches("train", seed=0), 2), take(wl.batches("train", seed=0), 2)
    assert all(same(x, y) for x, y in zip(a, b))
    first = tokens(a[0])
    assert not torch.equal(first, tokens(a[1]))
    assert not torch.equal(first, tokens(next(wl.batches("train", seed=1))))
    assert not torch.equal(first, tokens(next(wl.batches("val", seed=0))))


@pytest.mark.parametrize("name", ALL)
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


@pytest.mark.parametrize("name", ALL)
def test_forward_backward_reaches_every_parameter(name):
    wl = tiny(name)
    model = wl.build_model()
    batch = next(wl.batches())
    x, out = tokens(batch), logits(model, batch)
    if wl.kind == "text":
        assert out.shape == (*x.shape, wl.settings["vocab_size"])
    else:
        assert out.shape == (x.shape[0], wl.settings["num_classes"])
    loss = wl.loss(model, batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


def _val_loss(wl, model, batches):
    model.eval()
    with torch.no_grad():
        loss = sum(float(wl.loss(model, b)) for b in batches) / len(batches)
    model.train()
    return loss


@pytest.mark.parametrize("name", ALL)
def test_loss_falls_on_held_out_batches_under_adamw(name):
    _, lr, min_drop = TINY[name]
    wl = tiny(name)
    model = wl.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    val = take(wl.batches("val"), 4)
    before = _val_loss(wl, model, val)
    for batch in take(wl.batches("train"), 30):
        loss = wl.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = _val_loss(wl, model, val)
    assert after < before - min_drop, (before, after)


def test_initial_loss_is_near_chance():
    """Small init gives uniform predictions, so the first loss is ~ln(classes): a check that
    the logits and the loss are wired to the right axis."""
    for name in [n for n in ALL if isinstance(n, str)]:
        wl = tiny(name)
        batch = next(wl.batches())
        classes = wl.settings.get("vocab_size") or wl.settings["num_classes"]
        with torch.no_grad():
            loss = float(wl.loss(wl.build_model(), batch))
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


@pytest.mark.parametrize("name, causal", [("gpt", True), ("llama", True), ("bert", False), ("user-gpt", True),
                                         (_needs("hf-llama"), True), (_needs("hf-gpt2"), True),
                                         (_needs("hf-bert"), False)])
def test_decoders_are_causal_and_the_encoder_is_not(name, causal):
    model = tiny(name).build_model().eval()
    x = tokens(next(tiny(name).batches()))[:1]
    changed = x.clone()
    changed[0, -1] = (x[0, -1] + 1) % 512

    def run(ids):
        return model(input_ids=ids).logits if name in HF else model(ids)

    with torch.no_grad():
        early = (run(x)[0, :-1] - run(changed)[0, :-1]).abs().max()
    assert (early == 0) if causal else (early > 0)


def test_user_gpt_is_written_in_a_users_names():
    from turbotrain.workloads.user_gpt import next_token_loss

    wl = tiny("user-gpt")
    model = wl.build_model()
    assert isinstance(model.layers, nn.Sequential) and not hasattr(model, "blocks")
    layer = model.layers[0]
    for proj in ("query_proj", "key_proj", "value_proj", "output_proj"):
        assert isinstance(getattr(layer.attention, proj), nn.Linear)
    ff = layer.feed_forward
    assert isinstance(ff.fc1, nn.Linear) and isinstance(ff.fc2, nn.Linear)
    assert isinstance(ff.act, nn.GELU) and ff.act.approximate == "tanh"
    names = {n for n, _ in model.named_modules()}
    assert not names & {"lm_head", "ln_f", "blocks"}  # none of turbotrain's (HF's) names
    assert wl.loss_fn is next_token_loss


@pytest.mark.parametrize("name", [_needs(n) for n in HF])
def test_hf_batches_are_dicts_with_labels_and_the_model_owns_the_loss(name):
    wl = tiny(name)
    assert wl.loss_fn is None
    batch = next(wl.batches())
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
    assert torch.equal(batch["attention_mask"], torch.ones_like(batch["input_ids"]))
    labels = batch["labels"]
    if name == "hf-bert":  # masked LM: labels only where a token was chosen, the original token there
        chosen = labels != -100
        assert 0 < chosen.sum() < labels.numel()
    else:  # causal LM: the model shifts the labels itself
        assert torch.equal(labels, batch["input_ids"])
    model = wl.build_model()
    assert torch.equal(wl.loss(model, batch), model(**batch).loss)


def test_hf_workload_without_transformers_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(HardwareError, match=r"hf-llama workload needs transformers.*pip install 'turbotrain\[hf\]'"):
        get_workload("hf-llama", **TEXT)


@pytest.mark.parametrize("name", [_needs(n) for n in FOREIGN_WORKLOADS])
def test_foreign_workloads_train_through_the_engine_and_a_peer_row(name):
    """Two steps each through an Engine row and the autocast peer: finite losses, the same first
    loss (same seed, same batch), and the weights move."""
    from turbotrain.bench.peers import PeerTrainer
    from turbotrain.bench.tt import EngineTrainer

    wl = tiny(name)
    batches = take(wl.batches("train"), 2)
    first = {}
    for label, build in (("engine", lambda: EngineTrainer(wl, "cpu", precision="bf16-master")),
                         ("peer", lambda: PeerTrainer(wl, "cpu", amp=True))):
        torch.manual_seed(0)
        trainer = build()
        before = [p.detach().float().clone() for p in trainer.model.parameters()]
        losses = [float(trainer.step(b)) for b in batches]
        assert all(math.isfinite(x) for x in losses), (label, losses)
        after = list(trainer.model.parameters())
        assert any(not torch.equal(b, a.detach().float()) for b, a in zip(before, after)), label
        assert math.isfinite(trainer.eval_loss(batches[:1]))
        first[label] = losses[0]
    # bf16 weights (master mode) vs bf16 autocast of fp32 weights round differently: ~0.5% of ~9 nats
    assert first["engine"] == pytest.approx(first["peer"], rel=5e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["user-gpt", _needs("hf-gpt2")])
def test_foreign_workloads_train_through_the_compiled_step_reference(name):
    from turbotrain.bench.peers import CompiledStepTrainer, PeerTrainer

    wl = tiny(name)
    batches = take(wl.batches("train"), 3)
    torch.manual_seed(0)
    compiled = [float(CompiledStepTrainer(wl, "cpu").step(b)) for b in batches[:1]]
    torch.manual_seed(0)
    eager = [float(PeerTrainer(wl, "cpu", amp=True).step(b)) for b in batches[:1]]
    # the same bf16 autocast, compiled or not: fused kernels round differently, ~0.1% of the loss
    assert compiled == pytest.approx(eager, rel=2e-3)


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


@pytest.mark.parametrize("model_type, objective, mlp", [("qwen2", "causal", 320), ("gpt_neox", "causal", 256),
                                                        ("roberta", "masked", 256), ("gpt2", "causal", None)])
def test_any_transformers_family_is_a_workload_at_the_shared_shape(model_type, objective, mlp):
    """hf:<model_type> builds the family's own model at d/n_layer/n_head/T/vocab, with the family's
    MLP ratio (Qwen2's 22016/4096 at d=64: 344, to the nearest 64: 320), no dropout and its own loss."""
    pytest.importorskip("transformers")
    wl = get_workload(f"hf:{model_type}", **TEXT)
    assert wl.settings["objective"] == objective and wl.loss_fn is None
    model = wl.build_model()
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 1, 4)
    assert config.vocab_size == wl.settings["vocab_size"]
    if mlp is not None:
        assert getattr(config, "intermediate_size") == mlp
    assert not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    batch = next(wl.batches())
    chosen = batch["labels"] != -100
    assert chosen.all() if objective == "causal" else 0 < chosen.sum() < chosen.numel()
    loss = wl.loss(model, batch)
    assert loss.dim() == 0 and math.log(config.vocab_size) * 0.8 < float(loss) < math.log(config.vocab_size) * 1.3
    loss.backward()


@pytest.mark.parametrize("model_type, sizes", [
    ("gptj", {"rotary_dim": 4}),  # GPT-J's rotary part, 64 of a 256-wide head: a quarter of the shape's 16
    ("deepseek_v3", {"qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "kv_lora_rank": 16}),
    ("cwm", {"bos_token_id": 259 - 1}),  # its bos id lies outside the small vocabulary and may not be None
    ("gpt_neo", {"attention_layers": ["global"]}),  # a per-layer list the class checks against the depth
])
def test_hf_families_with_per_head_sizes_and_strict_token_ids_build_and_train(model_type, sizes):
    """Sizes tied to the head width (GPT-J's partial rotary, DeepSeek's latent attention) follow the
    shape's head (they raised shape errors at the default sizes), a token id the config class does not
    let be None takes an id inside the vocabulary, and a per-layer list keeps its first n_layer."""
    pytest.importorskip("transformers")
    wl = get_workload(f"hf:{model_type}", **dict(TEXT, vocab_size=259))
    model = wl.build_model()
    assert {k: getattr(model.config, k) for k in sizes} == sizes
    loss = wl.loss(model, next(wl.batches()))
    assert math.isfinite(float(loss))
    loss.backward()


def test_a_multimodal_transformers_type_is_refused_naming_its_language_model():
    pytest.importorskip("transformers")
    with pytest.raises(UnknownWorkloadError, match="multimodal.*hf:gemma3_text"):
        get_workload("hf:gemma3", **TEXT)


def test_an_hf_model_too_big_for_the_machine_is_refused_before_it_is_built(monkeypatch):
    """A family's config can size parts hf:<model_type> does not scale (BLT's hash embeddings: 4.6e9
    parameters at any shape, and the OS killed the process building it): the workload counts the
    parameters on the meta device and refuses, naming the largest tensor, before allocating any."""
    pytest.importorskip("transformers")
    from turbotrain.workloads import hf

    monkeypatch.setattr(hf, "machine_memory", lambda: 2**20)
    with pytest.raises(ConfigError, match=r"hf:qwen2 has .* parameters .*model.embed_tokens.weight.* 0 GiB"):
        get_workload("hf:qwen2", **TEXT)
    monkeypatch.setattr(hf, "machine_memory", lambda: 2**34)
    assert get_workload("hf:qwen2", **TEXT).name == "hf:qwen2"


@pytest.mark.parametrize("name, match", [("hf:no_such_family", "no causal- or masked-LM model of type"),
                                         ("hf:t5", "no causal- or masked-LM"), ("hf:bart", "encoder-decoder"), ("hf:", "unknown workload")])
def test_a_transformers_type_that_is_not_a_language_model_workload_is_refused(name, match):
    pytest.importorskip("transformers")
    with pytest.raises(UnknownWorkloadError, match=match):
        get_workload(name, **TEXT)


def test_hf_auto_settings_are_checked_like_the_others():
    with pytest.raises(ConfigError, match="no setting 'width'"):
        get_workload("hf:qwen2", width=3)
