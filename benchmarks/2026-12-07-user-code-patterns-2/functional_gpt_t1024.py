"""functional_gpt.py at T=1024 (B=8): the memory side of issue 18 on the tied functional head.
Run with FG_T=1024 in the environment, so the bench's worker processes build the same model."""
import os
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import functional_gpt as fg  # noqa: E402

if __name__ == "__main__":
    from turbotrain.bench import compare

    assert fg.T == 1024 and os.environ.get("FG_T") == "1024", "run with FG_T=1024"
    compare(fg.build, fg.batches(12, 0), val_batches=fg.batches(2, 1), loss_fn=fg.lm_loss, configs=sys.argv[2],
            rounds=int(sys.argv[1]), out=sys.argv[3], unit="tokens")
