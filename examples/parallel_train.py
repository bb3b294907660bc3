"""Train a model sharded over two processes: FSDP2, or tensor + sequence parallel.

    turbotrain launch --nproc 2 examples/parallel_train.py --mode fsdp --model gpt
    turbotrain launch --nproc 2 examples/parallel_train.py --mode tp-sp --model hf-llama

The training loop is ordinary turbotrain: an Engine over the model and the user's own AdamW, with
``Config(parallel=...)`` choosing how the model is split. Two things are the user's to get right,
and this script shows both:

* **which rows each process trains on.** Under FSDP (``dp_shard=2``) each process is its own
  data-parallel group and takes its half of the global batch. Under tensor parallel (``tp=2``)
  the two processes *are* one group: they hold halves of every weight matrix and must be given the
  same rows.
* **the same model on every process.** Each process builds the model from the same seed (the
  Engine also broadcasts rank 0's weights before it shards them).

``--model gpt`` is turbotrain's nanoGPT-style decoder on text (the ``gpt`` workload's corpus),
``(inputs, targets)`` batches and a loss function; ``--model hf-llama`` is a tiny Hugging Face
``LlamaForCausalLM`` built from a config (nothing is downloaded) on dict batches with ``labels``,
whose loss the model computes itself. Rank 0 prints the loss averaged over the processes.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist

import turbotrain
from turbotrain.parallel import ParallelConfig

MODES = {
    # every parameter, gradient and Adam moment cut in two: half the model state per process
    "fsdp": ParallelConfig(dp_shard=2),
    # every attention and MLP matrix cut in two; the norms and residual stream split along the sequence
    "tp-sp": ParallelConfig(dp_shard=1, tp=2, sequence_parallel=True),
}
GLOBAL_BATCH, SEQ = 8, 32


def build_gpt():
    """A turbotrain gpt, its text batches and its loss function."""
    from turbotrain.workloads import get_workload

    workload = get_workload("gpt", d=64, n_layer=2, n_head=4, T=SEQ, B=GLOBAL_BATCH, vocab_size=512)
    return workload.build_model(), workload.batches("train", seed=0), workload.loss_fn


def build_hf_llama():
    """A tiny LlamaForCausalLM (4 query heads, 2 key/value heads: tp=2 divides both) and counting batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 256
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)

    def batches():
        # Each row counts up from a random start by a random stride (mod the vocabulary): the next
        # token is learnable from the two before it. The model shifts the labels itself.
        g = torch.Generator().manual_seed(0)  # the same stream on every process
        while True:
            start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=g)
            stride = torch.randint(1, 8, (GLOBAL_BATCH, 1), generator=g)
            ids = (start + stride * torch.arange(SEQ)) % vocab
            yield {"input_ids": ids, "labels": ids.clone()}

    return model, batches(), None


def my_rows(batch, index: int, groups: int):
    """This data-parallel group's share of the global batch (rows ``index::groups`` would do as well)."""
    if isinstance(batch, dict):
        return {k: v.chunk(groups)[index] for k, v in batch.items()}
    return tuple(t.chunk(groups)[index] for t in batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=tuple(MODES), default="fsdp")
    parser.add_argument("--model", choices=("gpt", "hf-llama"), default="gpt")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial weights on every process
    model, batches, loss_fn = build_gpt() if args.model == "gpt" else build_hf_llama()
    parallel = MODES[args.mode]
    engine = turbotrain.Engine(model, torch.optim.AdamW(model.parameters(), lr=args.lr), loss_fn,
                               config=turbotrain.Config(parallel=parallel))

    # The Engine has joined the processes by now. tp ranks form one data-parallel group.
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = world // parallel.tp
    group = rank // parallel.tp

    losses = []
    for step in range(args.steps):
        loss = engine.step(my_rows(next(batches), group, groups)).loss.detach().clone()
        dist.all_reduce(loss)  # the mean over the processes (tp ranks agree, so it is theirs too)
        losses.append(loss.item() / world)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        print(f"parallel_train: mode={args.mode} model={args.model} world={world} "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps", flush=True)
    # Let the sharded model and the Engine go while the process group they use still exists: left to
    # the interpreter's exit, they were freed after the group, and a rank sometimes aborted there with
    # "terminate called without an active exception" (gloo, FSDP; about 1 run in 12).
    del engine, model
    gc.collect()
    dist.barrier()  # every rank done with its collectives before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
