"""Meta's reference-Llama style (complex rotary, hand-written RMSNorm, F.silu SwiGLU) at the ladder's
scale, trained on dict batches with its own key names, its forward returning {"logits", "loss"}:
the run's own code names the targets (the fused head's own-loss path, e698f74)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import models2  # noqa: E402

V, D, H, L, T, B = 8192, 512, 8, 4, 256, 8
models2.V, models2.D, models2.H, models2.L, models2.T = V, D, H, L, T


class DictLlama(models2.MetaLlama):
    def forward(self, tokens, targets=None):
        logits = super().forward(tokens)
        out = {"logits": logits}
        if targets is not None:
            out["loss"] = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return out


def build():
    torch.manual_seed(0)
    return DictLlama()


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(0, V, (B, 1), generator=g) + torch.arange(T + 1) * 7
        ids = torch.where(torch.rand(B, T + 1, generator=g) < 0.2, torch.randint(0, V, (B, T + 1), generator=g), base % V)
        out.append({"tokens": ids[:, :-1].contiguous(), "targets": ids[:, 1:].contiguous()})
    return out


if __name__ == "__main__":
    from turbotrain.bench import compare

    compare(build, batches(24, 0), val_batches=batches(4, 1), configs=sys.argv[2], rounds=int(sys.argv[1]),
            out=sys.argv[3], unit="tokens")
