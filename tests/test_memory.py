"""Activation checkpointing: same gradients, same state_dict keys, fewer bytes kept alive."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from turbotrain.errors import ConfigError
from turbotrain.memory import (
    apply_checkpointing,
    checkpointed_blocks,
    is_recomputing,
    remove_checkpointing,
    saved_activation_bytes,
    saved_tensor_bytes,
)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=61, d=32, heads=4, layers=3, seq=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(vocab=61, seq=16, batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def grads_of(model, batch, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout masks must match; checkpoint replays the RNG state
    loss_fn(model(batch[0]), batch[1]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_gradients_match_plain_model(mode):
    torch.manual_seed(0)
    plain = TinyGPT()
    ckpt = apply_checkpointing(copy.deepcopy(plain), mode)
    batch = make_batch()
    want, got = grads_of(plain, batch), grads_of(ckpt, batch)
    assert want.keys() == got.keys()
    for name in want:
        # fp32, same kernels in the same order: recomputation is bitwise in practice; 1e-6 leaves
        # room for a backend that reassociates a reduction when re-run.
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_compiled_checkpointing_has_no_graph_breaks_and_same_gradients(mode):
    # The eager path counts calls to tell recomputation from the first forward; dynamo cannot trace
    # that side effect and broke the graph at every block. Compiled, the checkpoint becomes one op.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    plain = TinyGPT().eval()  # no dropout: compiled and eager RNG streams differ
    ckpt = apply_checkpointing(copy.deepcopy(plain), mode)
    batch = make_batch()
    want = grads_of(plain, batch)
    compiled = torch.compile(ckpt)
    ckpt.zero_grad(set_to_none=True)
    loss_fn(compiled(batch[0]), batch[1]).backward()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    for name, p in ckpt.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_state_dict_keys_unchanged_and_removable(mode):
    model = TinyGPT()
    keys = list(model.state_dict())
    apply_checkpointing(model, mode)
    assert list(model.state_dict()) == keys
    assert [m for _, m in checkpointed_blocks(model)] == [mode] * 3
    assert checkpointed_blocks(copy.deepcopy(model)) == checkpointed_blocks(model)
    TinyGPT().load_state_dict(model.state_dict())  # a checkpointed model's weights load into a plain one
    remove_checkpointing(model)
    assert checkpointed_blocks(model) == [] and type(model.blocks[0]) is Block


def test_checkpointing_keeps_fewer_activation_bytes():
    torch.manual_seed(0)
    model = TinyGPT(layers=4).eval()  # eval: no dropout masks, so the modes differ only in policy
    batch = make_batch(batch=4)
    plain = saved_activation_bytes(model, loss_fn, batch)
    # The reference count (saved_tensors_hooks) sees everything on an unwrapped model; the
    # retained-storage count adds only the logits the loss keeps, so it may not be smaller.
    reference = saved_tensor_bytes(model, loss_fn, batch)
    assert reference <= plain <= reference * 1.25
    selective = saved_activation_bytes(apply_checkpointing(model, "selective"), loss_fn, batch)
    blocks = saved_activation_bytes(apply_checkpointing(model, "blocks"), loss_fn, batch)
    assert blocks < selective < plain
    assert blocks < 0.5 * plain  # four blocks keep only their inputs


def test_no_grad_forward_is_unchanged():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    idx, _ = make_batch()
    with torch.no_grad():
        want = model(idx)
        got = apply_checkpointing(model, "selective")(idx)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_model_without_blocks_raises_with_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="nn.ModuleList"):
        apply_checkpointing(model, "blocks")


def test_unknown_mode_lists_choices():
    with pytest.raises(ConfigError, match="'blocks', 'selective'"):
        apply_checkpointing(TinyGPT(), "everything")


# -- the CPU's tensor peak (live_tensor_bytes + step_tensor_peak) ------------------------------------
def test_step_tensor_peak_is_the_high_water_of_the_step_own_allocations():
    from turbotrain.memory.measure import step_tensor_peak

    def run():
        a = torch.empty(1000, 250)   # 1 MB
        b = torch.empty(2000, 250)   # 2 MB on top: the high water, 3 MB
        del a
        c = torch.empty(500, 250)    # 0.5 MB after 1 MB freed: 2.5 MB, under the peak
        del b, c

    assert step_tensor_peak(run) == 3_000_000
    kept = []
    assert step_tensor_peak(lambda: kept.append(torch.empty(100, 100))) == 40_000


def test_live_tensor_bytes_passes_over_a_leftover_vmap_tensor():
    """A vmap BatchedTensor is typed as a plain tensor but has no storage: one left reachable (HF Mamba's
    compiled step left some) made the scan raise and the ladder mark torch-compile-step failed."""
    from turbotrain.memory.measure import live_tensor_bytes

    kept = []
    torch.vmap(lambda x: kept.append(x) or x * 2)(torch.randn(3, 4))
    before = live_tensor_bytes()
    extra = torch.zeros(250_000)
    assert live_tensor_bytes() - before == 1_000_000
    del extra, kept


def test_live_tensor_bytes_counts_each_storage_once():
    from turbotrain.memory.measure import live_tensor_bytes

    before = live_tensor_bytes()
    x = torch.empty(1000, 500)
    views = [x[:10], x.t(), x.view(-1)]  # views share the storage: not counted again
    assert live_tensor_bytes() - before == 2_000_000
    del x, views
    assert live_tensor_bytes() == before


def test_checkpointing_lowers_the_tensor_peak_of_a_training_step():
    """What the bench reports as a CPU row's tensor peak falls with checkpointing, as CUDA's would."""
    from turbotrain.memory.measure import step_tensor_peak

    torch.manual_seed(0)
    plain = TinyGPT(d=64, seq=128, layers=4)
    ckpt = apply_checkpointing(copy.deepcopy(plain), "blocks")
    batch = make_batch(seq=128, batch=8)

    def step(model):
        loss_fn(model(batch[0]), batch[1]).backward()
        model.zero_grad(set_to_none=True)

    step(plain), step(ckpt)  # lazy one-time allocations out of the way
    assert step_tensor_peak(lambda: step(ckpt)) < 0.7 * step_tensor_peak(lambda: step(plain))


def test_checkpoint_every_second_block_keeps_about_half_and_the_same_gradients():
    torch.manual_seed(0)
    model = TinyGPT(layers=4)
    batch = make_batch()
    ref = grads_of(model, batch)
    half = apply_checkpointing(copy.deepcopy(model), "blocks", every=2)
    assert [path for path, _ in checkpointed_blocks(half)] == ["blocks.0", "blocks.2"]
    got = grads_of(half, batch)
    assert all(torch.allclose(got[n], ref[n], atol=1e-6) for n in ref)
    none, all_ = saved_activation_bytes(model, loss_fn, batch), saved_activation_bytes(
        apply_checkpointing(copy.deepcopy(model), "blocks"), loss_fn, batch)
    halfway = saved_activation_bytes(half, loss_fn, batch)
    assert all_ < halfway < none
    # applying again with every=1 checkpoints the other blocks too; every=4 leaves only the first
    assert len(checkpointed_blocks(apply_checkpointing(half, "blocks"))) == 4
    assert [p for p, _ in checkpointed_blocks(apply_checkpointing(half, "blocks", every=4))] == ["blocks.0"]


def test_checkpoint_every_needs_checkpoint_and_a_positive_integer():
    from turbotrain import Config

    with pytest.raises(ConfigError, match="set checkpoint='blocks'"):
        Config(checkpoint_every=2)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        Config(checkpoint="blocks", checkpoint_every=0)
    assert Config.from_dict(Config(checkpoint="blocks", checkpoint_every=2).to_dict()).checkpoint_every == 2


def test_engine_checkpoints_every_other_block_and_trains_the_same():
    from turbotrain import Config, Engine
    from turbotrain.workloads import get_workload

    work = get_workload("gpt", d=32, n_layer=4, n_head=4, T=16, B=4, vocab_size=512)
    stream = work.batches("train", seed=0)
    data = [next(stream) for _ in range(3)]
    losses = {}
    for every in (None, 2):
        torch.manual_seed(0)
        model = work.build_model()
        extra = {} if every is None else {"checkpoint": "blocks", "checkpoint_every": every}
        engine = Engine(model, torch.optim.AdamW(model.parameters()), work.loss_fn, config=Config(device="cpu", **extra))
        losses[every] = [float(engine.step(b).loss) for b in data]
    assert "(every 2: 2 of 4 blocks)" in engine.describe()
    assert losses[2] == pytest.approx(losses[None], rel=1e-5)


class SelfCheckpointedGPT(TinyGPT):
    """A model that calls torch.utils.checkpoint in its own forward (as Hugging Face's
    gradient_checkpointing_enable() does), not through Config(checkpoint=...)."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_models_own_checkpoint_calls_recompute_under_the_fp32_keep_list(reentrant):
    # bf16-master runs LayerNorm in FP32 under a function mode; a recompute in backward without it ran
    # the norms in bf16: the non-reentrant checkpoint refused the step (its saved and recomputed
    # tensors differ in dtype), the reentrant one took other gradients than the forward's ops give.
    from turbotrain import Config, Engine

    losses = {}
    for own in (None, reentrant):
        torch.manual_seed(0)
        model = TinyGPT() if own is None else SelfCheckpointedGPT(own)
        engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn,
                        config=Config(device="cpu", precision="bf16-master"))
        seen = []  # the profiler leaves recomputation out of model FLOPs: it must be told which is which
        model.blocks[0].ln1.register_forward_hook(lambda *_: seen.append(is_recomputing()))
        losses[own] = []
        for seed in range(4):
            torch.manual_seed(seed)  # the same dropout masks in both runs
            losses[own].append(float(engine.step(make_batch(seed=seed)).loss))
        assert seen == ([False] * 4 if own is None else [False, True] * 4)
    assert losses[reentrant] == pytest.approx(losses[None], rel=1e-6, abs=0)
    # torch's own functions are back once the forward is done
    import torch.utils.checkpoint as tuc

    assert issubclass(tuc.CheckpointFunction, torch.autograd.Function)
    assert tuc._checkpoint_without_reentrant_generator.__module__ == "torch.utils.checkpoint"
