"""BART's forward in bf16-master, eager and compiled under the Engine's forward context, against
FP32: the loss, the logits and each hidden state's relative error, and the loss recomputed from
each run's logits in FP32 and in bf16 (the compiled loss was the FP32 value rounded to bf16)."""
import torch, turbotrain
from models8 import hf_bart, seq2seq_batches
torch.set_num_threads(2)
b = seq2seq_batches(1)[0]
torch.manual_seed(0); ref_m = hf_bart()
with torch.no_grad():
    ref = ref_m(**b, output_hidden_states=True)
torch.manual_seed(0); m = hf_bart()
e = turbotrain.Engine(m, lambda p: torch.optim.SGD(p, lr=0.0), config=turbotrain.Config(precision="auto"))
e.step(b)
mod = e.module
cm = torch.compile(mod)
def rel(a, r): return float((a.float() - r.float()).norm() / r.float().norm())
with torch.no_grad(), e.precision.forward_context():
    eg = mod(**b, output_hidden_states=True)
    cp = cm(**b, output_hidden_states=True)
print("loss", float(ref.loss), f"eager {float(eg.loss)/float(ref.loss)-1:+.1e} compiled {float(cp.loss)/float(ref.loss)-1:+.1e}")
print("logits eager", rel(eg.logits, ref.logits), "compiled", rel(cp.logits, ref.logits))
for i, (a, c, r) in enumerate(zip(eg.encoder_hidden_states, cp.encoder_hidden_states, ref.encoder_hidden_states)):
    print("enc", i, f"{rel(a, r):.2e} {rel(c, r):.2e}")
for i, (a, c, r) in enumerate(zip(eg.decoder_hidden_states, cp.decoder_hidden_states, ref.decoder_hidden_states)):
    print("dec", i, f"{rel(a, r):.2e} {rel(c, r):.2e}")
import torch.nn.functional as F
lab = b["labels"].view(-1)
for name, out in (("eager", eg), ("compiled", cp)):
    lg = out.logits.reshape(-1, out.logits.shape[-1])
    print(name, "loss", float(out.loss), "logits dtype", out.logits.dtype, "CE fp32 of its logits", float(F.cross_entropy(lg.float(), lab)),
          "CE bf16", float(F.cross_entropy(lg.bfloat16(), lab).float()))
