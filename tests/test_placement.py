"""Data parallel on GPUs: each rank's model and FP32 masters are made on its own GPU, which
requires the process group and set_device before the model moves (the Engine's place() hook)."""

import torch

from turbotrain.comm import env as comm_env
from turbotrain.comm.config import DataParallelConfig
from turbotrain.comm.env import DistInfo
from turbotrain.comm.transform import DataParallelTransform


def test_each_rank_is_placed_on_its_local_gpu_before_anything_is_allocated(monkeypatch):
    calls = []
    info = DistInfo(rank=1, world_size=2, local_rank=1, backend="nccl", device=torch.device("cuda", 1),
                    launcher="torchrun")
    monkeypatch.setattr(comm_env, "init", lambda *a, **k: calls.append("init") or info)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    device = DataParallelTransform(DataParallelConfig()).place(torch.device("cuda"))
    assert device == torch.device("cuda", 1)
    assert calls == ["init", ("set_device", torch.device("cuda", 1))]


def test_the_engine_places_before_it_moves_the_model(monkeypatch):
    """place() runs in Engine.__init__ before model.to(device): the device it returns is used."""
    import turbotrain
    from turbotrain import engine as engine_module

    seen = {}

    class Probe(turbotrain.plan.Transform):
        name = "probe"

        def place(self, device):
            seen["placed"] = True
            return torch.device("cpu")

        def apply(self, model, plan, ctx):
            seen["apply_device"] = next(model.parameters()).device

    real = engine_module.build_transforms
    monkeypatch.setattr(engine_module, "build_transforms", lambda c, d: [Probe(), *real(c, d)])
    model = torch.nn.Linear(4, 2)
    engine = turbotrain.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                               config=turbotrain.Config(device="cpu"))
    assert seen == {"placed": True, "apply_device": torch.device("cpu")} and engine.device == torch.device("cpu")
