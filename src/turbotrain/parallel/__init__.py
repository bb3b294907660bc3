"""Past one process's memory: FSDP2 sharding (of models built on the meta device too), tensor, sequence and
context parallel, sharded checkpoints.

Built on torch.distributed's own engines (``fully_shard``, ``parallelize_module``, DeviceMesh,
``torch.distributed.checkpoint``); this package chooses the mesh, the plans and the mixed-precision
policies, and fits them to the Engine's transform protocol. See docs/parallel.md.
"""

from .checkpoint import EXTRA_FILE, consolidate, load_sharded, run_consolidate, save_sharded
from .clipping import clip_grad_norm_, grad_norm
from .config import MESH_DIMS, ParallelConfig, ResolvedDegrees
from .context import ContextParallelMode, context_parallel_runner, heads_to_sequence, sequence_to_heads, split_batch
from .meta_init import InitTape, hf_init_weights, local_piece, record_init, reset_parameters
from .nonfinite import nonfinite_error
from .tp_plans import LAYOUTS, TPLayout, find_layout, register_layout
from .transform import ParallelTransform, agree_found_inf, build_mesh, data_parallel_mesh, mixed_precision_policies

__all__ = [
    # configuration
    "ParallelConfig", "ResolvedDegrees", "MESH_DIMS",
    # the transform and its pieces
    "ParallelTransform", "build_mesh", "data_parallel_mesh", "mixed_precision_policies", "agree_found_inf",
    "grad_norm", "clip_grad_norm_", "nonfinite_error",
    # building on the meta device
    "reset_parameters", "hf_init_weights", "record_init", "InitTape", "local_piece",
    # context parallel
    "ContextParallelMode", "context_parallel_runner", "split_batch", "sequence_to_heads", "heads_to_sequence",
    # tensor-parallel plans
    "TPLayout", "LAYOUTS", "register_layout", "find_layout",
    # sharded checkpoints
    "save_sharded", "load_sharded", "consolidate", "run_consolidate", "EXTRA_FILE",
]
