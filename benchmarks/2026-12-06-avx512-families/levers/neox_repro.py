import sys, torch, transformers
from turbotrain import Engine, Config
from turbotrain.fusion.optim import fused_adamw
attn = sys.argv[1] if len(sys.argv) > 1 else "auto"
prec = sys.argv[2] if len(sys.argv) > 2 else "bf16-master"
torch.manual_seed(0)
cfg = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=256, max_position_embeddings=64)
cfg._attn_implementation = "sdpa"
model = transformers.GPTNeoXForCausalLM(cfg)
eng = Engine(model, lambda ps: fused_adamw(ps, lr=1e-3), config=Config(precision=prec, fuse=("linear_cross_entropy",),
             compile=True, attention=attn))
x = torch.randint(0, 256, (4, 32))
for i in range(3):
    out = eng.step({"input_ids": x, "labels": x})
    print(i, float(out.loss))
