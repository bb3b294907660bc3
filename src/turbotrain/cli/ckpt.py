"""``turbotrain ckpt consolidate DIR OUT.pt``: one stock single-file state_dict from a sharded checkpoint."""

from __future__ import annotations

__all__ = ["add_parsers"]


def _consolidate(args) -> int:
    from ..parallel import run_consolidate

    print(run_consolidate(args.directory, args.out))
    return 0


def add_parsers(subparsers, parents=()) -> None:
    """Register ``turbotrain ckpt``."""
    p = subparsers.add_parser("ckpt", parents=parents, help="work with checkpoints")
    sub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    c = sub.add_parser("consolidate", parents=parents,
                       help="write one plain state_dict (loads into the unwrapped model) from a sharded checkpoint")
    c.add_argument("directory", help="the directory Engine.save wrote with Config(parallel=...)")
    c.add_argument("out", help="the .pt file to write")
    c.set_defaults(func=_consolidate)
