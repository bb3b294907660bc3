"""turbotrain rows: the same workload trained through ``turbotrain.Engine`` with one Config each.

Engine, the precision modes and fusion are separate features; a row whose feature is missing or
refuses the config fails in its own worker with the error message, and the ladder goes on.
"""

from __future__ import annotations

from ..errors import TurbotrainError
from .configs import make_optimizer, register_config

__all__ = ["EngineTrainer", "FeatureUnavailable", "TT_CONFIGS", "LEVER_CONFIGS", "MEMORY_CONFIGS", "ABLATION_CONFIGS",
           "FP32_TWINS"]


class FeatureUnavailable(TurbotrainError):
    """A benchmark row needs a turbotrain feature this checkout does not have yet."""


def _compute_dtype(precision: str) -> str:
    return {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[precision.split("-")[0]]


class EngineTrainer:
    """A workload behind ``Engine(model, AdamW, loss_fn, config=Config(**settings))``."""

    def __init__(self, workload, device: str, **settings):
        try:
            from .. import Config, Engine
        except ImportError as exc:
            raise FeatureUnavailable(f"turbotrain.Engine/Config cannot be imported ({exc}); "
                                     "this row runs once src/turbotrain/engine.py exists") from exc
        config = Config(device=device, **settings)
        model = workload.build_model().to(device)
        # the ladder's one AdamW (fused), as in every peer row: the Engine re-points this instance
        # at the parameters it trains, so the row steps the same implementation it was given
        self._optimizer = make_optimizer(model.parameters())
        self.engine = Engine(model, self._optimizer, workload.loss_fn, config=config)
        self.compute_dtype = _compute_dtype(config.precision)
        self.compiled = config.compile

    @property
    def model(self):
        return self.engine.model

    @property
    def optimizer(self):
        return self.engine.optimizer or self._optimizer

    def step(self, batch):
        return self.engine.step(batch).loss

    def eval_loss(self, batches) -> float:
        return float(self.engine.eval_loss(batches))


#: name -> (Config fields, description, devices it is in the default ladder on)
TT_CONFIGS = {
    "tt-fp32": ({"precision": "fp32"}, "Engine in fp32: Engine overhead over fp32-eager", True),
    "tt-bf16-mixed": ({"precision": "bf16-mixed"}, "Engine, bf16 autocast, fp32 weights", True),
    "tt-bf16-master": ({"precision": "bf16-master"}, "Engine, bf16 model + fp32 master weights", True),
    # fp16 matmul on CPUs without avx512_fp16/AMX-FP16 is emulated (~25x slower than fp32), so the
    # row would dominate a CPU ladder's wall time; run it there with --configs tt-fp16-master.
    "tt-fp16-master": ({"precision": "fp16-master"}, "Engine, fp16 model + fp32 master + loss scaling",
                       ("cuda",)),
    # What a user gets from Config(fuse=True) without compile (fusion.transform.patterns_for): on a
    # CPU the chunked linear+cross-entropy alone (QKV 0.93x and Linear+GELU 0.95x of the unfused
    # bf16 step in the 2026-12-02 ablation), every pattern with its Triton kernels on a GPU.
    "tt-fused": ({"precision": "bf16-master", "fuse": True},
                 "bf16-master + Config(fuse=True): the fused loss head on a CPU, every pattern on a GPU", True),
    # Under torch.compile inductor fuses the elementwise ops itself; the QKV slice cache breaks the
    # graph (9 graphs instead of 1), so only linear+cross-entropy is fused by hand here. On a CPU in
    # bf16, Config(attention='auto') also runs attention as compiled plain PyTorch (fusion/attention.py).
    "tt-fused-compile": ({"precision": "bf16-master", "fuse": ("linear_cross_entropy",), "compile": True},
                         "bf16-master + fusion + torch.compile (+ compiled plain attention on a CPU in bf16)", True),
    # fp32 twins of the fused rows: where bf16 matmul is slower than fp32 (a CPU without
    # avx512_bf16/amx_bf16; precision='auto' picks fp32 there) the default ladder runs these instead.
    "tt-fused-fp32": ({"precision": "fp32", "fuse": ("linear_cross_entropy",)},
                      "fp32 + fused linear+cross-entropy", False),
    "tt-fused-compile-fp32": ({"precision": "fp32", "fuse": ("linear_cross_entropy",), "compile": True},
                              "fp32 + fused linear+cross-entropy + torch.compile", False),
}
#: Levers measured before they are made defaults (off the default ladder; name them in --configs).
LEVER_CONFIGS = {
    # tt-fused-compile with torch's attention kernel (on a CPU in bf16 Config(attention='auto') runs
    # compiled plain attention instead): the plain-attention lever's effect, row against row
    "tt-fused-compile-stock-attn": ({"precision": "bf16-master", "fuse": ("linear_cross_entropy",), "compile": True,
                                     "attention": "stock"},
                                    "tt-fused-compile with the stock scaled_dot_product_attention kernel"),
    # tt-fused-compile-fp32 with compiled plain attention (Config(attention='auto') keeps the stock
    # kernel in fp32): whether the lever pays where bf16 is emulated and the ladder runs fp32 twins
    "tt-fused-compile-fp32-plain-attn": ({"precision": "fp32", "fuse": ("linear_cross_entropy",), "compile": True,
                                          "attention": "plain"},
                                         "tt-fused-compile-fp32 with compiled plain attention"),
    # no hand-fused op: Inductor compiles the head and the cross-entropy itself
    "tt-compile": ({"precision": "bf16-master", "compile": True},
                   "bf16-master + torch.compile (forward and loss one graph), no hand-fused ops"),
}
#: The row standing in for each low-precision row where its dtype is slower than fp32 (BenchConfig.fp32_twin).
FP32_TWINS = {"tt-fused": "tt-fused-fp32", "tt-fused-compile": "tt-fused-compile-fp32",
              "tt-ckpt-half-fused-ce-compile": "tt-ckpt-half-fused-ce-compile-fp32",
              "tt-ckpt-selective-fused-ce-compile": "tt-ckpt-selective-fused-ce-compile-fp32"}

#: Activation checkpointing rows (issue: memory): off the default ladder, they answer a question
#: asked at long sequence lengths (`--set T=1024`), where activations dominate peak memory.
MEMORY_CONFIGS = {
    "tt-ckpt-blocks": ({"precision": "bf16-master", "checkpoint": "blocks"},
                       "bf16-master + activation checkpointing of every block"),
    "tt-ckpt-selective": ({"precision": "bf16-master", "checkpoint": "selective"},
                          "bf16-master + selective checkpointing (matmul outputs kept)"),
    # The logits and their softmax sit outside the blocks and are the largest activation at long
    # T; fused linear+cross-entropy removes them, which checkpointing alone cannot.
    "tt-ckpt-blocks-fused-ce": ({"precision": "bf16-master", "checkpoint": "blocks",
                                 "fuse": ("linear_cross_entropy",)},
                                "bf16-master + block checkpointing + fused linear+cross-entropy"),
    # fp32 versions, for CPUs where bf16 matmul is emulated; compiled, the checkpoint is one graph op
    "tt-ckpt-blocks-fused-ce-fp32": ({"precision": "fp32", "checkpoint": "blocks",
                                      "fuse": ("linear_cross_entropy",)},
                                     "fp32 + block checkpointing + fused linear+cross-entropy"),
    "tt-ckpt-blocks-fused-ce-compile-fp32": ({"precision": "fp32", "checkpoint": "blocks",
                                              "fuse": ("linear_cross_entropy",), "compile": True},
                                             "fp32 + block checkpointing + fused linear+cross-entropy + torch.compile"),
    # selective on every block: keep the matmul and attention outputs, recompute the norms, the
    # activation and the residual adds in backward (a few percent of the step's work)
    "tt-ckpt-selective-fused-ce-compile": ({"precision": "bf16-master", "checkpoint": "selective",
                                            "fuse": ("linear_cross_entropy",), "compile": True},
                                           "bf16-master + selective checkpointing + fused linear+cross-entropy "
                                           "+ torch.compile"),
    "tt-ckpt-selective-fused-ce-compile-fp32": ({"precision": "fp32", "checkpoint": "selective",
                                                 "fuse": ("linear_cross_entropy",), "compile": True},
                                                "fp32 + selective checkpointing + fused linear+cross-entropy "
                                                "+ torch.compile"),
    # every other block: about half the activations for about half the recomputation
    "tt-ckpt-half-fused-ce-compile": ({"precision": "bf16-master", "checkpoint": "blocks", "checkpoint_every": 2,
                                       "fuse": ("linear_cross_entropy",), "compile": True},
                                      "bf16-master + checkpointing of every other block + fused linear+cross-entropy "
                                      "+ torch.compile"),
    "tt-ckpt-half-fused-ce-compile-fp32": ({"precision": "fp32", "checkpoint": "blocks", "checkpoint_every": 2,
                                            "fuse": ("linear_cross_entropy",), "compile": True},
                                           "fp32 + checkpointing of every other block + fused linear+cross-entropy "
                                           "+ torch.compile"),
}


#: Fusion ablation: bf16-master plus one pattern at a time, and all of them (off the default ladder).
ABLATION_CONFIGS = {
    f"tt-fuse-{pattern.replace('_', '-')}": ({"precision": "bf16-master", "fuse": (pattern,)},
                                              f"bf16-master + the {pattern} fusion alone")
    for pattern in ("qkv", "linear_cross_entropy", "linear_act", "layernorm_gelu")
}
ABLATION_CONFIGS["tt-fuse-all"] = ({"precision": "bf16-master", "fuse": "all"},
                                   "bf16-master + every fusion pattern")


def _builder(settings: dict):
    return lambda workload, device: EngineTrainer(workload, device, **settings)


for _name, (_settings, _description, _default) in TT_CONFIGS.items():
    register_config(_name, _description, _builder(_settings), default=_default, group="turbotrain",
                    dtype=_compute_dtype(_settings["precision"]), fp32_twin=FP32_TWINS.get(_name))
for _name, (_settings, _description) in LEVER_CONFIGS.items():
    register_config(_name, _description, _builder(_settings), default=False, group="turbotrain",
                    dtype=_compute_dtype(_settings["precision"]))
for _group, _configs in (("memory", MEMORY_CONFIGS), ("ablation", ABLATION_CONFIGS)):
    for _name, (_settings, _description) in _configs.items():
        register_config(_name, _description, _builder(_settings), default=False, group=_group,
                        dtype=_compute_dtype(_settings["precision"]), fp32_twin=FP32_TWINS.get(_name))
