"""Tiny Hugging Face models built from configs (nothing is downloaded) and learnable padded batches."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, T, B = 128, 24, 4
MASK_ID = 1


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    tf = transformers
    if family == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return tf.LlamaForCausalLM(cfg)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                            bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg)
    if family == "bert":
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=96, max_position_embeddings=64)
        return tf.BertForMaskedLM(cfg)
    raise ValueError(family)


FAMILIES = ("llama", "gpt2", "bert")


def batches(family: str, n: int, seed: int = 0, t: int = T):
    """Arithmetic token sequences (learnable), right-padded rows, labels -100 on the padding.

    bert gets masked-LM batches: 15% of the real tokens are replaced by MASK_ID and every real token
    is scored (the unmasked ones teach it quickly, the masked ones need the context).
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(2, VOCAB, (B, 1), generator=g)
        step = torch.randint(1, 4, (B, 1), generator=g)
        ids = 2 + (start + step * torch.arange(t)) % (VOCAB - 2)
        mask = torch.ones(B, t, dtype=torch.long)
        mask[0, t - 5:] = 0
        mask[2, t - 9:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        if family == "bert":
            chosen = (torch.rand(B, t, generator=g) < 0.15) & (mask == 1)
            ids = ids.masked_fill(chosen, MASK_ID)
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def unpadded_row(batch: dict, row: int) -> dict:
    """One row of a batch with its padding cut off."""
    length = int(batch["attention_mask"][row].sum())
    return {k: v[row:row + 1, :length] for k, v in batch.items()}
