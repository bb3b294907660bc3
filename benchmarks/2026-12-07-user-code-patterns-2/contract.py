import sys, torch, turbotrain, warnings
warnings.simplefilter("ignore")
import torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, "/tmp/foreign3")
from models2 import MODELS as M2, _tokens
from transformers import BatchEncoding
cls, loss_fn, mk = M2["shared"]
def run(name, batches, loss=loss_fn, cfg=dict(precision="auto", fuse=True), model=None):
    torch.manual_seed(0); m = model or cls()
    try:
        eng = turbotrain.Engine(m, lambda p: torch.optim.AdamW(p, lr=1e-3), loss, config=turbotrain.Config(**cfg))
        out = [round(float(eng.step(b).loss), 4) for b in batches]
        print(f"{name:28s} ok {out}")
    except Exception as e:
        print(f"{name:28s} {type(e).__name__}: {str(e)[:300]}")
tb = _tokens(3)
run("tuple", tb)
run("list (DataLoader collate)", [[x, y] for x, y in tb])
from torch.utils.data import TensorDataset, DataLoader
X = torch.cat([x for x, _ in tb]); Y = torch.cat([y for _, y in tb])
run("DataLoader", list(DataLoader(TensorDataset(X, Y), batch_size=4)))
def loss_tuple(logits, y):
    l = F.cross_entropy(logits.flatten(0, 1), y.flatten()); return l, {"acc": (logits.argmax(-1) == y).float().mean()}
run("loss_fn returns (loss, dict)", tb, loss=loss_tuple)
class DictIn(nn.Module):
    def __init__(self): super().__init__(); self.m = cls()
    def forward(self, input_ids, labels=None):
        logits = self.m(input_ids)
        return {"logits": logits, "loss": None if labels is None else F.cross_entropy(logits.flatten(0,1), labels.flatten())}
run("BatchEncoding", [BatchEncoding({"input_ids": x, "labels": y}) for x, y in tb], loss=None, model=DictIn())
run("dict + extra non-tensor key", [{"input_ids": x, "labels": y, "meta": ["a"] * 4} for x, y in tb], loss=None, model=DictIn())
run("dict + extra tensor key", [{"input_ids": x, "labels": y, "idx": torch.arange(4)} for x, y in tb], loss=None, model=DictIn())
run("accumulate=2 clip", tb + tb, cfg=dict(precision="auto", fuse=True, accumulate=2, clip_grad_norm=1.0))
run("int32 targets", [(x, y.int()) for x, y in tb])
run("uint8 inputs", [(x.to(torch.int32), y) for x, y in tb])
run("batch of 1 row", [(x[:1], y[:1]) for x, y in tb])
run("last batch smaller", [tb[0], tb[1], (tb[2][0][:3], tb[2][1][:3])], cfg=dict(precision="auto", fuse=True, compile=True))
