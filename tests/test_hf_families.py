"""Transformers families turbotrain has no code for, built from configs at a tiny size and trained
through the Engine against the plain loop a user writes: the same losses step by step (fp32), with
dropout left on where the family has it (set-up must not move the random stream), and the fused
sites each family offers."""

import pytest
import torch

from turbotrain import Config, Engine

transformers = pytest.importorskip("transformers")

VOCAB, T, B, STEPS = 128, 24, 4, 4
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
_DECODER = dict(_SHAPE, intermediate_size=96, num_key_value_heads=2, max_position_embeddings=64)

#: family -> (config class, model class, config kwargs, what fuse='all' must fuse; "lce" is the loss head)
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", _DECODER, {"qkv", "swiglu", "lce"}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_DECODER, head_dim=16), {"qkv", "swiglu", "lce"}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_DECODER, head_dim=16), {"qkv", "linear_act"}),  # soft cap: no lce
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_DECODER, pad_token_id=0), {"lce"}),  # q/k/v, gate/up already one Linear
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_DECODER, num_local_experts=4, num_experts_per_tok=2),
                {"qkv", "lce"}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_SHAPE, intermediate_size=96, max_position_embeddings=64),
                 {"linear_act", "lce"}),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(_SHAPE, ffn_dim=96, max_position_embeddings=64, word_embed_proj_dim=64),
            {"qkv", "lce"}),  # dropout 0.1
    "falcon": ("FalconConfig", "FalconForCausalLM", _SHAPE, {"lce"}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(_SHAPE, intermediate_size=96, max_position_embeddings=80),
                {"qkv", "linear_act", "lce"}),  # dropout 0.1
    "t5": ("T5Config", "T5ForConditionalGeneration",  # encoder-decoder: the decoder's inputs come from the labels
           dict(vocab_size=VOCAB, d_model=64, d_ff=96, num_layers=2, num_heads=4, d_kv=16, decoder_start_token_id=0,
                pad_token_id=0, eos_token_id=1), {"qkv", "linear_act", "lce"}),  # dropout 0.1
}


def build(family: str):
    config_class, model_class, kwargs, _ = FAMILIES[family]
    torch.manual_seed(0)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs))


def batches(n: int):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        start, step = torch.randint(2, VOCAB, (B, 1), generator=g), torch.randint(1, 4, (B, 1), generator=g)
        ids = 2 + (start + step * torch.arange(T)) % (VOCAB - 2)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, T - 5:] = 0
        out.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)})
    return out


def plain_losses(family: str, data) -> list[float]:
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def engine_losses(family: str, data, config: Config):
    model = build(family)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=2e-3), config=config)
    losses = [float(engine.step(b).loss) for b in data]
    fused = {s.pattern for s in engine.fusion_report.fused} if engine.fusion_report else set()
    head = engine._transform("fusion").loss_head if config.fuse else None
    if head is not None and head.fused:
        fused.add("lce")
    return losses, fused, engine


@pytest.mark.parametrize("family", FAMILIES)
def test_fuse_all_trains_each_family_as_the_plain_loop_does(family):
    data = batches(STEPS)
    expected = plain_losses(family, data)
    losses, fused, _ = engine_losses(family, data, Config(device="cpu", fuse="all"))
    assert fused == FAMILIES[family][3]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-6, atol=0)


@pytest.mark.parametrize("compile", [False, True])
def test_fuse_true_on_a_cpu_fuses_the_loss_head_alone_and_says_why(compile):
    """fuse=True is the patterns that pay: on a CPU (and under compile anywhere) the loss head alone;
    the others measured slower there, and the Engine says which it left out."""
    torch._dynamo.reset()
    data = batches(2)
    expected = plain_losses("mistral", data)
    losses, fused, engine = engine_losses("mistral", data, Config(device="cpu", fuse=True, compile=compile))
    assert fused == {"lce"}
    text = engine.describe()
    assert "linear_cross_entropy only; linear_act, qkv, layernorm_gelu, swiglu left out" in text
    assert "Config(fuse='all')" in text
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("opt", "roberta", "t5")])  # compiled dropout draws other masks
@pytest.mark.parametrize("checkpoint", [None, "selective"])
def test_fuse_and_compile_train_each_family_as_the_plain_loop_does(family, checkpoint):
    torch._dynamo.reset()
    data = batches(STEPS)
    expected = plain_losses(family, data)
    losses, _, engine = engine_losses(family, data, Config(device="cpu", fuse="all", compile=True, checkpoint=checkpoint))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-5, atol=0)
    assert engine.step(data[0]).recompiles == 0


#: Dropout off where a family has it (compiled dropout draws other masks, ~1% apart in bf16 on T5).
NO_DROPOUT = {"opt": dict(dropout=0.0, attention_dropout=0.0),
              "roberta": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "t5": dict(dropout_rate=0.0)}


@pytest.mark.slow  # ten compiles in bf16: about four minutes on 2 cores
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_compile_trains_each_family_near_the_plain_loop(family, monkeypatch):
    """The Engine's fastest CPU path (bf16-master, fused, compiled, with compiled plain attention where
    bf16 is chosen) on every family: it builds (GPT-NeoX's parallel residual once did not:
    fusion/compile.py, fold_repeated_reductions) and follows the FP32 plain loop within bf16's
    rounding (measured up to 4.3e-4 apart, T5)."""
    config_class, model_class, kwargs, fused = FAMILIES[family]
    monkeypatch.setitem(FAMILIES, family, (config_class, model_class, dict(kwargs, **NO_DROPOUT.get(family, {})), fused))
    torch._dynamo.reset()
    data = batches(STEPS)
    expected = plain_losses(family, data)
    losses, _, engine = engine_losses(family, data, Config(device="cpu", precision="bf16-master", fuse=True,
                                                           compile=True))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-3, atol=0)
    assert engine.step(data[0]).recompiles == 0


def unpadded(n: int):
    """batches(n) with every token real: the all-ones mask a tokenizer gives an unpadded batch."""
    return [{"input_ids": b["input_ids"], "attention_mask": torch.ones_like(b["input_ids"]), "labels": b["input_ids"]}
            for b in batches(n)]


@pytest.mark.slow  # seven compiles: about a minute on 2 cores
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("opt", "roberta", "t5")])  # compiled dropout draws other masks
def test_compile_on_unpadded_batches_trains_each_family_as_the_plain_loop_does(family):
    """On an unpadded batch the compiled Engine asks sdpa for is_causal instead of a materialised mask
    (fusion/compile.py, unpadded_hf_masks), Mistral too: its window is longer than T."""
    torch._dynamo.reset()
    data = unpadded(STEPS)
    expected = plain_losses(family, data)
    losses, _, engine = engine_losses(family, data, Config(device="cpu", fuse=True, compile=True))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-5, atol=0)
    assert engine.step(data[0]).recompiles == 0


#: Families whose own code makes FP32 activations inside a model held in bf16: Mamba feeds its norm
#: ``x.to(norm.weight.dtype)`` (turbotrain keeps norm weights FP32) and the next Linear gets FP32; FNet
#: mixes tokens with an FFT, which has no bf16 CPU kernel. Neither takes an attention mask.
FP32_ACTIVATIONS = {
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                      state_size=8, pad_token_id=0)),
    "fnet": ("FNetConfig", "FNetForMaskedLM", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                   intermediate_size=96, max_position_embeddings=64,
                                                   hidden_dropout_prob=0.0, pad_token_id=0)),
}


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", FP32_ACTIVATIONS)
def test_bf16_master_trains_families_that_make_fp32_activations(family, compile, monkeypatch):
    """Each raised a dtype error at its first Linear (or FFT) under bf16-master; now the Engine casts
    those activations as autocast would and follows the FP32 plain loop within bf16's rounding."""
    config_class, model_class, kwargs = FP32_ACTIVATIONS[family]
    monkeypatch.setitem(FAMILIES, family, (config_class, model_class, kwargs, set()))
    torch._dynamo.reset()
    data = [{"input_ids": b["input_ids"], "labels": b["labels"]} for b in batches(STEPS)]
    expected = plain_losses(family, data)
    losses, _, _ = engine_losses(family, data, Config(device="cpu", precision="bf16-master", fuse="all",
                                                      compile=compile))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-3, atol=0)
