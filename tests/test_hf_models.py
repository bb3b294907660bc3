"""Hugging Face models trained as their users train them: dict batches with padding, the model's own
``labels=`` loss, no loss_fn, through Engine(model, optimizer, config=Config(...))."""

import copy

import pytest
import torch

from turbotrain import Config, Engine
from turbotrain.memory import checkpointed_blocks

from hf_models import FAMILIES, batches, build, transformers, unpadded_row

#: What Config(fuse='all') fuses in each family (README lists the same). GPT-2's attention and MLP
#: projections are transformers' Conv1D, not nn.Linear, so only its head's loss is fused.
EXPECTED_FUSED = {
    "llama": {"qkv", "swiglu", "linear_cross_entropy"},
    "gpt2": {"linear_cross_entropy"},
    "bert": {"qkv", "linear_act", "linear_cross_entropy"},
}


def train(family, config, steps, seed=0, data=None):
    model = build(family, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    engine = Engine(model, opt, config=config)
    assert engine.optimizer is opt or not engine.ready
    losses = [float(engine.step(b).loss) for b in (data or batches(family, steps))]
    assert engine.optimizer is opt
    return engine, losses


def fused_patterns(engine) -> set:
    report = engine.fusion_report
    found = {s.pattern for s in report.fused}
    head = engine._transform("fusion").loss_head
    if head is not None and head.fused:
        found.add("linear_cross_entropy")
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_the_models_own_loss_trains_and_low_precision_stays_within_1pct_of_fp32(family):
    data = batches(family, 50)
    _, ref = train(family, Config(device="cpu"), 50, data=data)
    assert ref[-1] < 0.8 * ref[0]
    for precision in ("bf16-master", "bf16-mixed", "fp16-master"):
        _, losses = train(family, Config(device="cpu", precision=precision), 50, data=data)
        assert abs(losses[-1] - ref[-1]) <= 0.01 * ref[-1] + 0.02, (precision, losses[-1], ref[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_fuse_all_fuses_every_family_it_lists_and_keeps_the_loss(family):
    data = batches(family, 20)
    _, ref = train(family, Config(device="cpu", precision="bf16-master"), 20, data=data)
    engine, losses = train(family, Config(device="cpu", precision="bf16-master", fuse="all"), 20, data=data)
    assert fused_patterns(engine) >= EXPECTED_FUSED[family], engine.describe()
    assert abs(losses[-1] - ref[-1]) <= 0.01 * ref[-1] + 0.02
    # the fused model saves in the stock layout: its state_dict loads into the plain HF model
    plain = build(family, seed=1)
    plain.load_state_dict(engine.state_dict()["model"])


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_blocks_finds_the_decoder_or_encoder_layers(family):
    data = batches(family, 10)
    _, ref = train(family, Config(device="cpu"), 10, data=data)
    engine, losses = train(family, Config(device="cpu", checkpoint="blocks"), 10, data=data)
    assert len(checkpointed_blocks(engine.module)) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_users_script_compiles_once_and_trains(family):
    """The issue's acceptance script: auto precision, fuse=True, compile=True, no loss_fn."""
    torch._dynamo.reset()
    engine, losses = train(family, Config(precision="auto", fuse=True, compile=True), 20)
    stats = engine.step(batches(family, 1, seed=5)[0])
    assert stats.recompiles == 0
    assert losses[-1] < losses[0]
    assert fused_patterns(engine)


def test_seq_buckets_give_one_graph_per_bucket_on_hf_llama():
    torch._dynamo.reset()
    model = build("llama")
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                    config=Config(device="cpu", compile=True, seq_buckets=(16, 32)))
    lengths = (10, 16, 20, 13, 31, 8)
    for i, t in enumerate(lengths):
        stats = engine.step(batches("llama", 1, seed=i, t=t)[0])
    assert stats.recompiles <= 1  # the second bucket's graph


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_padding_for_buckets_leaves_the_loss_of_each_row_unchanged(family):
    """Causal (llama) and bidirectional (bert): a right-padded row scores as the row alone."""
    model = build(family)
    model.eval()
    batch = batches(family, 1, t=12)[0]
    row = unpadded_row(batch, 0)  # length 7
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), config=Config(device="cpu", seq_buckets=(16,)))
    padded_loss = engine.eval_loss([row])
    with torch.no_grad():
        alone = float(copy.deepcopy(model)(**row).loss)
    assert padded_loss == pytest.approx(alone, rel=1e-5)


def test_gemma2s_soft_capped_logits_keep_their_own_loss():
    """Gemma 2 caps its logits (tanh(z/30)*30) before the loss: the fused head would skip the cap, which
    on an initialised model's small logits the loss check alone cannot see."""
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=2e-3), config=Config(device="cpu", fuse="all"))
    engine.step(batches("llama", 1)[0])
    head = engine._transform("fusion").loss_head
    assert not head.fused and "log-softmax" in head.reason, head.reason
    assert {s.pattern for s in engine.fusion_report.fused} >= {"qkv"}


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_the_accumulation_correct_loss_keeps_its_token_count_with_the_fused_head(family):
    """With ``num_items_in_batch`` (what Hugging Face's Trainer passes under gradient accumulation) the
    model's loss is a summed cross-entropy divided by that count: the head used to compute the loss
    alone, which the set-up check rolled back (a sum where the run divides); it now answers the
    model's own cross-entropy call and the division stays."""
    data = [dict(b, num_items_in_batch=(b["labels"][:, 1:] != -100).sum()) for b in batches(family, 3)]
    _, ref = train(family, Config(device="cpu"), 3, data=data)
    engine, losses = train(family, Config(device="cpu", fuse=("linear_cross_entropy",)), 3, data=data)
    head = engine._transform("fusion").loss_head
    assert head.fused and head.through_loss, head.reason
    assert losses == pytest.approx(ref, rel=1e-5)


def test_checkpoint_blocks_on_t5_switches_off_the_decoder_stacks_own_cache():
    """T5ForConditionalGeneration passes use_cache=None down, and its decoder stack reads a copy of the
    config of its own: with only model.config.use_cache switched off the decoder still wrote a KV cache,
    and the recomputation, which found it full, failed ("a different number of tensors was saved")."""
    def run(config):
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0))
        engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
        g = torch.Generator().manual_seed(1)
        losses = [float(engine.step({"input_ids": torch.randint(1, 64, (2, 10), generator=g),
                                     "labels": torch.randint(1, 64, (2, 8), generator=g)}).loss) for _ in range(3)]
        return engine, losses

    _, ref = run(Config(device="cpu"))
    engine, losses = run(Config(device="cpu", checkpoint="blocks"))
    assert checkpointed_blocks(engine.module)
    assert not any(getattr(getattr(m, "config", None), "use_cache", False) for m in engine.module.modules())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-5)


def test_checkpoint_blocks_on_a_model_that_checkpoints_itself_is_refused_with_the_fix():
    from turbotrain.errors import ConfigError

    model = build("llama")
    model.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match=r"checkpoints its own layers .*gradient_checkpointing_disable\(\)"):
        engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                        config=Config(device="cpu", checkpoint="blocks"))
        engine.step(batches("llama", 1)[0])
    # the model's own checkpointing alone trains
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=Config(device="cpu"))
    assert torch.isfinite(engine.step(batches("llama", 1)[0]).loss)
