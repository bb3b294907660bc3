"""Page 2's tied functional GPT (Gemma-style head written as a matmul on the embedding, nn.RMSNorm,
d512, T=256, vocab 8192) trained with F.cross_entropy's label smoothing, as T5/ViT recipes and many
user loops set it; FG_LOSS=weighted adds class weights to the smoothing.

    python smoothed_gpt.py ROUNDS CONFIGS OUT

Before c100c7d the fused head was refused for this loss (label smoothing), so tt-fused-compile ran
as tt-compile does; now the loss's own F.cross_entropy call is answered by the fused kernel."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-07-user-code-patterns-2"))
from functional_gpt import V, batches, build  # noqa: E402


def smoothed_loss(logits, y):
    weight = None
    if os.environ.get("FG_LOSS") == "weighted":  # rarer tokens weigh more, as a frequency-balanced loss does
        weight = torch.linspace(0.5, 1.5, V, device=logits.device)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), label_smoothing=0.1, weight=weight)


if __name__ == "__main__":
    from turbotrain.bench import compare

    compare(build, batches(24, 0), val_batches=batches(4, 1), loss_fn=smoothed_loss, configs=sys.argv[2],
            rounds=int(sys.argv[1]), out=sys.argv[3], unit="tokens")
