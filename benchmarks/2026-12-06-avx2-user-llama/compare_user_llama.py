"""Issue 18's comparison on a model the project has no code for, run the way a user runs it:
turbotrain.bench.compare on the Llama of tests/test_user_llama.py (written as Meta's reference code:
an RMSNorm class, rotary embeddings as complex numbers, F.silu in the FeedForward, the loss in a user
function), at the ladder's gpt shape (d512, 4 layers, 8 heads, SwiGLU 1408, vocab 8192, T256, B8),
on the gpt workload's text batches (its tokenizer and corpus).

    PYTHONPATH=<clone>/src python benchmarks/2026-12-06-avx2-user-llama/compare_user_llama.py OUT [--malloc-tuned]
"""

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_user_llama import Transformer, loss_fn  # noqa: E402

import turbotrain.bench  # noqa: E402

TRAIN_BATCHES, VAL_BATCHES = 48, 4


def build():
    torch.manual_seed(0)
    return Transformer(vocab=8192, dim=512, layers=4, heads=8, hidden=1408, max_len=256)


if __name__ == "__main__":
    from turbotrain.workloads import get_workload

    text = get_workload("gpt")  # T=256, B=8, vocab 8192: (inputs, next tokens) from the stdlib corpus
    train = list(itertools.islice(text.batches("train", seed=0), TRAIN_BATCHES))
    val = list(itertools.islice(text.batches("val", seed=0), VAL_BATCHES))
    turbotrain.bench.compare(build, train, loss_fn=loss_fn, val_batches=val, out=sys.argv[1], unit="tokens",
                             configs=["torch-compile-step-fp32", "tt-fused-fp32", "tt-fused-compile-fp32"],
                             malloc_tuned="--malloc-tuned" in sys.argv[2:])
