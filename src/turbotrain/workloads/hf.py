"""``hf-llama``, ``hf-gpt2``, ``hf-bert``: Hugging Face transformers models on the stdlib corpus.

Models are built from a config (nothing is downloaded) at the shared shape fields of gpt/llama,
and trained the Hugging Face way: each batch is a dict ``{input_ids, attention_mask, labels}``
passed as ``model(**batch)``, and the loss is the model's own (``output.loss``), so the workload's
``loss_fn`` is None. The causal models get ``labels = input_ids`` (the model shifts them); bert
gets BERT's masked-LM batches (the bert workload's ``mask_tokens``: 15% chosen, 80/10/10), with
``labels`` -100 where nothing is predicted. Windows never hold padding, so the attention mask is
all ones; it is passed because a user's collator always passes it.

Choices that keep rows comparable, not defaults a user would notice: dropout 0 (compiled and eager
rows draw dropout masks from different generators, so with dropout on, their losses would differ
by chance and the ladder's loss check would measure luck), ``use_cache=False`` (a training loop
has no use for the KV cache the causal models otherwise build on every forward), and SDPA
attention. transformers is imported when a workload is built: ``pip install 'turbotrain[hf]'``.

>>> from turbotrain.workloads import get_workload
>>> wl = get_workload("hf-llama", d=64, n_layer=1, n_head=4, T=32, B=2)
>>> sorted(next(wl.batches()))
['attention_mask', 'input_ids', 'labels']
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..utils import require
from .base import Workload
from .bert import check_mask_prob, mask_tokens
from .data import load_corpus, sample_windows, seeded_build, split_generator
from .gpt import TransformerSettings
from .llama import LlamaSettings

__all__ = ["HFSettings", "HFBertSettings", "make_llama", "make_gpt2", "make_bert", "dict_batches", "HF_WORKLOADS"]

HF_WORKLOADS = ("hf-llama", "hf-gpt2", "hf-bert")


@dataclass(frozen=True)
class HFSettings(TransformerSettings):
    """The shape fields gpt and llama share; the MLP widths are each family's own (see the builders)."""


@dataclass(frozen=True)
class HFBertSettings(HFSettings):
    mask_prob: float = 0.15
    """Fraction of positions that carry a label (BERT's 15%)."""

    def __post_init__(self):
        super().__post_init__()
        check_mask_prob(self.mask_prob)


def _transformers(name: str):
    return require("transformers", "hf", f"the {name} workload")


def dict_batches(vocab_size: int, batch_size: int, seq_len: int, *, masked=None):
    """A ``Workload.batches`` callable yielding Hugging Face dict batches from the corpus.

    Causal: ``labels`` is ``input_ids`` (the model shifts). ``masked(window, corpus, generator) ->
    (inputs, targets)`` makes masked-LM batches instead (targets -100 where not chosen).
    """

    def batches(split: str = "train", seed: int = 0, device="cpu"):
        generator = split_generator(seed, split)
        corpus = load_corpus(vocab_size)
        return _stream(corpus, corpus.split(split), generator, device)

    def _stream(corpus, tokens, generator, device):
        while True:
            window = sample_windows(tokens, batch_size, seq_len, generator)
            inputs, labels = masked(window, corpus, generator) if masked else (window, window.clone())
            batch = {"input_ids": inputs, "attention_mask": torch.ones_like(inputs), "labels": labels}
            yield {k: v.to(device) for k, v in batch.items()}

    return batches


def _workload(name: str, s: HFSettings, build, description: str, masked=None, settings: dict | None = None) -> Workload:
    return Workload(
        name=name,
        kind="text",
        unit="tokens",
        items_per_batch=s.B * s.T,
        build_model=seeded_build(build, s.init_seed),
        loss_fn=None,
        batches=dict_batches(s.vocab_size, s.B, s.T, masked=masked),
        description=f"{description} d={s.d} L={s.n_layer} H={s.n_head} T={s.T} on stdlib source, "
        "dict batches, the model's own loss",
        settings=settings or asdict(s),
    )


def make_llama(settings: HFSettings | None = None) -> Workload:
    """transformers' LlamaForCausalLM at the llama workload's sizes (SwiGLU width 8/3*d rounded to 64)."""
    s = settings or HFSettings()
    tf = _transformers("hf-llama")
    hidden = LlamaSettings(d=s.d, n_head=s.n_head).hidden  # the llama workload's width, so the two compare
    config = tf.LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.d, intermediate_size=hidden, num_hidden_layers=s.n_layer,
        num_attention_heads=s.n_head, num_key_value_heads=s.n_head, max_position_embeddings=s.T,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_dropout=0.0, use_cache=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    return _workload("hf-llama", s, lambda: tf.LlamaForCausalLM(config), "transformers LlamaForCausalLM",
                     settings={**asdict(s), "intermediate_size": hidden})


def make_gpt2(settings: HFSettings | None = None) -> Workload:
    """transformers' GPT2LMHeadModel (tied embeddings, Conv1D projections, GELU-tanh MLP of 4*d)."""
    s = settings or HFSettings()
    tf = _transformers("hf-gpt2")
    config = tf.GPT2Config(
        vocab_size=s.vocab_size, n_embd=s.d, n_layer=s.n_layer, n_head=s.n_head, n_positions=s.T,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    return _workload("hf-gpt2", s, lambda: tf.GPT2LMHeadModel(config), "transformers GPT2LMHeadModel")


def make_bert(settings: HFBertSettings | None = None) -> Workload:
    """transformers' BertForMaskedLM (post-LN encoder, MLP of 4*d) on masked-LM batches."""
    s = settings or HFBertSettings()
    tf = _transformers("hf-bert")
    config = tf.BertConfig(
        vocab_size=s.vocab_size, hidden_size=s.d, num_hidden_layers=s.n_layer, num_attention_heads=s.n_head,
        intermediate_size=4 * s.d, max_position_embeddings=s.T, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=None, attn_implementation="sdpa")

    def masked(window, corpus, generator):
        return mask_tokens(window, corpus.mask_id, corpus.vocab_size, s.mask_prob, generator)

    return _workload("hf-bert", s, lambda: tf.BertForMaskedLM(config),
                     f"transformers BertForMaskedLM (MLM, {s.mask_prob:.0%} masked)", masked=masked)
