import sys; sys.path.insert(0, "/tmp/foreign3")
import torch, turbotrain, warnings
from transformers import LlamaConfig, LlamaForCausalLM
from models2 import _tokens, V, D, H, L, T
torch.set_num_threads(2)
def build():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=3 * D, num_hidden_layers=L,
                            num_attention_heads=H, num_key_value_heads=2, max_position_embeddings=T))
def batches():
    out = []
    for x, _ in _tokens(4):
        lab = x.clone(); lab[:2, 50:] = -100
        out.append({"input_ids": x, "labels": lab, "num_items_in_batch": (lab[:, 1:] != -100).sum()})
    return out
m = build(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3); ref = []
for b in batches():
    l = m(**b).loss; opt.zero_grad(); l.backward(); opt.step(); ref.append(l.item())
for cfg in (dict(precision="fp32", fuse=True), dict(precision="auto", fuse=True), dict(precision="auto", fuse=True, compile=True)):
    eng = turbotrain.Engine(build(), lambda p: torch.optim.AdamW(p, lr=1e-3), config=turbotrain.Config(**cfg))
    ls = [float(eng.step(b).loss) for b in batches()]
    print(cfg, max(abs(a - b) / b for a, b in zip(ls, ref)))
    print("   ", [l for l in eng.describe().splitlines() if "linear_cross" in l][0][:250])
