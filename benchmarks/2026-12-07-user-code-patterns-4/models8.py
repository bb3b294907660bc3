"""Five more Hugging Face families from config, none in turbotrain: BART (encoder-decoder, its logits
plus a final_logits_bias buffer), BLOOM (ALiBi, fused query_key_value), GPT-J (parallel attention and
MLP, rotary on part of each head), Mistral with a sliding window, Qwen2-MoE (routed experts and a
shared expert, the router's auxiliary loss)."""
import torch

from models2 import V, D, H, L, T, _tokens


def hf_bart():
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = BartConfig(vocab_size=V, d_model=D, encoder_layers=L, decoder_layers=L, encoder_attention_heads=H,
                     decoder_attention_heads=H, encoder_ffn_dim=4 * D, decoder_ffn_dim=4 * D,
                     max_position_embeddings=T, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return BartForConditionalGeneration(cfg)


def hf_bloom():
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM(BloomConfig(vocab_size=V, hidden_size=D, n_layer=L, n_head=H,
                                        hidden_dropout=0.0, attention_dropout=0.0))


def hf_gptj():
    from transformers import GPTJConfig, GPTJForCausalLM
    return GPTJForCausalLM(GPTJConfig(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=T, rotary_dim=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def hf_mistral_window():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(vocab_size=V, hidden_size=D, intermediate_size=3 * D, num_hidden_layers=L,
                                            num_attention_heads=H, num_key_value_heads=H // 2,
                                            max_position_embeddings=T, sliding_window=16,
                                            attn_implementation="sdpa"))


def hf_qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    cfg = Qwen2MoeConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D, moe_intermediate_size=D,
                         shared_expert_intermediate_size=D, num_hidden_layers=L, num_attention_heads=H,
                         num_key_value_heads=H // 2, num_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=T, output_router_logits=True, router_aux_loss_coef=0.01,
                         attn_implementation="sdpa")
    return Qwen2MoeForCausalLM(cfg)


def causal_batches(n):
    return [{"input_ids": x, "labels": x} for x, _ in _tokens(n)]


def seq2seq_batches(n):  # summarise-like: the target is the source reversed
    return [{"input_ids": x, "labels": torch.flip(x, dims=[1])} for x, _ in _tokens(n)]


MODELS = {
    "hf-bart": (hf_bart, None, seq2seq_batches),
    "hf-bloom": (hf_bloom, None, causal_batches),
    "hf-gptj": (hf_gptj, None, causal_batches),
    "hf-mistral-window": (hf_mistral_window, None, causal_batches),
    "hf-qwen2-moe": (hf_qwen2_moe, None, causal_batches),
}
