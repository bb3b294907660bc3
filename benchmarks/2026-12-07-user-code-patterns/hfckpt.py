import torch, turbotrain, sys
from transformers import LlamaConfig, LlamaForCausalLM
torch.set_num_threads(2)
cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
def batches(n):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (x := torch.randint(0, 512, (4, 64), generator=g)), "labels": x.clone()} for _ in range(n)]
for reent in (False, True):
    torch.manual_seed(0); m = LlamaForCausalLM(cfg); m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reent}); m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3); ref = []
    for b in batches(4):
        l = m(**b).loss; opt.zero_grad(); l.backward(); opt.step(); ref.append(l.item())
    for prec in ("bf16-master",):
        for fuse in (False, True, "compile"):
            torch.manual_seed(0); m = LlamaForCausalLM(cfg); m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reent}); m.train()
            try:
                eng = turbotrain.Engine(m, lambda p: torch.optim.AdamW(p, lr=1e-3), config=turbotrain.Config(precision=prec, fuse=fuse is True, compile=fuse == "compile"))
                ls = [float(eng.step(b).loss) for b in batches(4)]
                print(f"reentrant={reent} {prec} fuse={fuse}: dev {max(abs(a-b)/b for a,b in zip(ls, ref)):.2e}", flush=True)
            except Exception as e:
                print(f"reentrant={reent} {prec} fuse={fuse}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
