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

from ..errors import ConfigError, UnknownWorkloadError
from ..utils import require
from .base import Workload
from .bert import check_mask_prob, mask_tokens
from .data import load_corpus, sample_windows, seeded_build, split_generator
from .gpt import TransformerSettings
from .llama import LlamaSettings

__all__ = ["HFSettings", "HFBertSettings", "HFAutoSettings", "make_llama", "make_gpt2", "make_bert", "make_auto",
           "dict_batches", "HF_WORKLOADS", "AUTO_PREFIX"]

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

    return _workload("hf-bert", s, lambda: tf.BertForMaskedLM(config),
                     f"transformers BertForMaskedLM (MLM, {s.mask_prob:.0%} masked)", masked=_masked_lm(s.mask_prob))


def _masked_lm(mask_prob: float):
    """BERT's masked-LM batches (the bert workload's ``mask_tokens``) as ``dict_batches`` takes them."""

    def masked(window, corpus, generator):
        return mask_tokens(window, corpus.mask_id, corpus.vocab_size, mask_prob, generator)

    return masked


# --- any transformers language model, by its model_type ---------------------------------------

#: ``--workload hf:<model_type>``: the prefix of a workload built from any transformers model type.
AUTO_PREFIX = "hf:"
#: Names a config may give its MLP width, in the order they are looked for.
_MLP_WIDTH_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "hidden_dim", "ffn_hidden_size")
#: Token-id fields that must index the (small) vocabulary when set.
_TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                  "cls_token_id", "mask_token_id")


@dataclass(frozen=True)
class HFAutoSettings(HFBertSettings):
    """The shape fields of every hf workload; ``mask_prob`` is used by the masked-LM families only."""


def auto_objective(model_type: str) -> str:
    """'masked' for a family with a masked-LM head (BERT's objective first), 'causal' for one with a
    causal-LM head; a type with neither is refused, naming a few that work."""
    _transformers(f"{AUTO_PREFIX}{model_type}")
    from transformers.models.auto import modeling_auto as auto

    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "masked"
    if model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal"
    raise UnknownWorkloadError(
        f"transformers has no causal- or masked-LM model of type {model_type!r}; "
        f"use a model_type such as llama, qwen2, mistral, gemma, gpt2, gpt_neox, opt, bert or roberta")


def refuse_multimodal(model_type: str, default) -> None:
    """A config with a ``text_config`` beside vision or audio ones is a multimodal model: hf:<model_type>
    trains text-only language models, so refuse it, naming its language model's own type where that is one."""
    text = getattr(default, "text_config", None)
    others = [k for k in (getattr(default, "sub_configs", None) or {}) if k != "text_config"]
    if text is None or not others:
        return
    from transformers.models.auto import modeling_auto as auto

    own = getattr(text, "model_type", None)
    lm = own in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or own in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    hint = f"; benchmark its language model as hf:{own}" if lm and own != model_type else ""
    raise UnknownWorkloadError(f"{model_type!r} is a multimodal model (text_config with {', '.join(others)}); "
                               f"hf:<model_type> trains text-only language models{hint}")


#: Bytes a parameter needs to train at the least: FP32 weight and gradient, AdamW's two moments.
TRAIN_BYTES_PER_PARAM = 16


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(name: str, build, memory_bytes: int | None = None) -> int:
    """Count ``build()``'s parameters on the meta device (nothing allocated) and refuse a model whose
    training state alone would not fit in this machine's memory: a family's config can size parts that
    hf:<model_type> does not scale (hash embeddings, vision towers), and the OS would kill the run.
    Returns the count (0 where the model cannot be built on the meta device: the real build reports)."""
    try:
        with torch.device("meta"):
            params = list(build().named_parameters())
    except Exception:  # noqa: BLE001 - the real build raises the family's own error
        return 0
    count = sum(p.numel() for _, p in params)
    memory = memory_bytes if memory_bytes is not None else machine_memory()
    need = count * TRAIN_BYTES_PER_PARAM
    if need > 0.8 * memory:
        biggest, tensor = max(params, key=lambda kv: kv[1].numel())
        raise ConfigError(
            f"{name} has {count:.3g} parameters at this shape ({tensor.numel():.3g} in {biggest}: the family's config "
            f"sizes parts that hf:<model_type> does not scale), so training needs at least {need / 2**30:.0f} GiB "
            f"({TRAIN_BYTES_PER_PARAM} bytes a parameter) and this machine has {memory / 2**30:.0f} GiB; benchmark "
            "a model you size yourself with turbotrain.bench.compare(model_fn, batches)")
    return count


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:240]}{'...' if len(text) > 240 else ''}"


def _even(x: float) -> int:
    return max(2, round(x / 2) * 2)


def _latent_attention(defaults: dict, head: int, width_ratio: float) -> dict:
    """Multi-head latent attention's sizes (DeepSeek V2/V3 and kin) at the shape's head width: the
    no-rope part of a query/key head is ``head``, the rope and value parts keep their ratio to it (the
    family's ``head_dim`` is the rope part), and the low-rank projections scale with the width."""
    nope = defaults["qk_nope_head_dim"]
    out = {"qk_nope_head_dim": head}
    for name in ("qk_rope_head_dim", "v_head_dim"):
        if isinstance(defaults.get(name), int):
            out[name] = _even(defaults[name] * head / nope)
    if "head_dim" in defaults and "qk_rope_head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]
    for name in ("kv_lora_rank", "q_lora_rank"):
        if isinstance(defaults.get(name), int):
            out[name] = max(16, round(defaults[name] * width_ratio / 16) * 16)
    return out


def _may_be_none(config, name: str) -> bool:
    """Whether the config class lets field ``name`` be None (a bare ``int`` annotation does not)."""
    for cls in type(config).__mro__:
        annotation = getattr(cls, "__annotations__", {}).get(name)
        if annotation is not None:
            return annotation not in (int, "int")
    return True


def auto_config(model_type: str, s: HFSettings):
    """The family's own config at the workload's shape: width, depth, heads (as many key/value heads as
    query heads), vocabulary, positions; the MLP at the family's default width-to-MLP ratio; sizes tied
    to the head width (partial rotary, latent attention) in the family's ratios; no dropout, no KV
    cache; token ids that fall outside the small vocabulary unset (the last id where the class refuses
    None); a per-layer list the class refuses at this depth cut to n_layer."""
    tf = _transformers(f"{AUTO_PREFIX}{model_type}")
    default = tf.AutoConfig.for_model(model_type)
    refuse_multimodal(model_type, default)
    defaults = default.to_dict()
    alias = dict(getattr(type(default), "attribute_map", {}) or {})

    def key(name: str) -> str:
        return alias.get(name, name)

    kwargs = {key("hidden_size"): s.d, key("num_hidden_layers"): s.n_layer,
              key("num_attention_heads"): s.n_head, key("vocab_size"): s.vocab_size, "use_cache": False}
    names = set(defaults) | set(alias)
    if "num_key_value_heads" in names:
        kwargs[key("num_key_value_heads")] = s.n_head
    head = s.d // s.n_head
    width = getattr(default, key("hidden_size"), None)
    if isinstance(defaults.get("qk_nope_head_dim"), int):
        kwargs.update(_latent_attention(defaults, head, s.d / width if isinstance(width, int) and width > 0 else 1.0))
    elif "head_dim" in names:
        kwargs[key("head_dim")] = head
    heads = getattr(default, key("num_attention_heads"), None)
    if isinstance(defaults.get("rotary_dim"), int) and isinstance(width, int) and isinstance(heads, int) and heads > 0:
        kwargs["rotary_dim"] = _even(defaults["rotary_dim"] * head / (width // heads))  # GPT-J, CodeGen: partial rotary
    if "max_position_embeddings" in names:
        kwargs[key("max_position_embeddings")] = s.T + 2  # roberta's positions start after its padding id
    for name in _MLP_WIDTH_KEYS:
        mlp = defaults.get(name)
        if isinstance(mlp, int) and isinstance(width, int) and width > 0:
            kwargs[name] = max(64, round(mlp / width * s.d / 64) * 64)
            break
    for name, value in defaults.items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            kwargs[name] = 0.0
    for name in _TOKEN_ID_KEYS:
        value = getattr(default, name, None)
        if isinstance(value, int) and value >= s.vocab_size:
            kwargs[name] = 0 if name == "decoder_start_token_id" else None if _may_be_none(default, name) \
                else s.vocab_size - 1
        elif isinstance(value, (list, tuple)):
            kwargs[name] = [v for v in value if v < s.vocab_size] or None
    try:
        return tf.AutoConfig.for_model(model_type, **kwargs)
    except Exception:
        # A per-layer list the class does not derive from the depth (Zamba's layer_types, GPT-Neo's
        # attention layers) must have n_layer entries: take its first n_layer, the pattern kept.
        layers = getattr(default, key("num_hidden_layers"), None)
        per_layer = {name: value[:s.n_layer] for name, value in defaults.items()
                     if isinstance(value, list) and isinstance(layers, int) and len(value) == layers > s.n_layer}
        if not per_layer:
            raise
        return tf.AutoConfig.for_model(model_type, **kwargs, **per_layer)


def make_auto(model_type: str, settings: HFAutoSettings | None = None) -> Workload:
    """Any transformers language model by ``model_type`` (``--workload hf:qwen2``), built from its own
    config at this workload's shape (:func:`auto_config`) and trained with its own ``labels=`` loss:
    causal-LM batches, or BERT's masked-LM batches for a family with a masked-LM head. SDPA attention
    where the family has it; where it does not, the model's own attention, and the description says so.
    Multimodal families (:func:`refuse_multimodal`) and models too big for this machine
    (:func:`check_fits`) are refused before anything is allocated."""
    s = settings or HFAutoSettings()
    name = f"{AUTO_PREFIX}{model_type}"
    objective = auto_objective(model_type)
    tf = _transformers(name)
    try:
        config = auto_config(model_type, s)
    except (UnknownWorkloadError, ConfigError):
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own validation, in one line
        raise ConfigError(f"{name}: transformers refused the family's config at this shape ({_one_line(e)}); "
                          "its config needs settings hf:<model_type> does not scale: benchmark it with "
                          "turbotrain.bench.compare(model_fn, batches) and a config you write") from e
    if getattr(config, "is_encoder_decoder", False):
        raise UnknownWorkloadError(f"{model_type!r} is an encoder-decoder model; hf:<model_type> trains decoder-only "
                                   "(causal) and encoder-only (masked) language models")
    auto_class = tf.AutoModelForMaskedLM if objective == "masked" else tf.AutoModelForCausalLM
    model_class = auto_class._model_mapping[type(config)]
    attention = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    config._attn_implementation = attention
    if not check_fits(name, lambda: model_class(config)):
        try:  # not buildable on the meta device: build it once for real, so its own error is one line here
            model_class(config)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{name}: {model_class.__name__} cannot be built at this shape ({_one_line(e)}); "
                              "benchmark it with turbotrain.bench.compare(model_fn, batches) and a config you "
                              "write") from e
    masked = _masked_lm(s.mask_prob) if objective == "masked" else None
    settings_out = {**asdict(s), "model_type": model_type, "objective": objective, "attention": attention,
                    "model_class": model_class.__name__}
    what = f"transformers {model_class.__name__} ({objective} LM, {attention} attention)"
    return _workload(name, s, lambda: model_class(config), what, masked=masked, settings=settings_out)
