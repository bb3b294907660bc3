"""torchrun command lines, with a one-node rendezvous that only loopback can reach.

torchrun's rendezvous store (a TCPStore in the agent process) listens on every interface, whatever
host it is given: ``--standalone``, ``--rdzv-endpoint=127.0.0.1:PORT`` and
``--master-addr=127.0.0.1`` all leave it on ``[::]``, so on a shared or public machine anyone who
can reach the port can write into the job's store. For one node,
``python -m turbotrain.comm.launch [torchrun options] script ...`` binds a socket to 127.0.0.1
itself, starts the store on it (``TCPStore(master_listen_fd=...)``) and then runs torchrun in the
same process with ``--master-addr=127.0.0.1 --master-port=<that port>``. torchrun's static
rendezvous asks for a ``multi_tenant`` store on the same port, and a multi-tenant TCPStore reuses
the server that already runs on it in this process, so the only listening socket is on loopback.
Binding port 0 also means the port cannot be taken between choosing it and using it.

Several nodes have to meet on a routable address: ``torchrun_command(nnodes=2, master_addr=...)``
passes it to torchrun as given.

>>> torchrun_command(2, "my_project.train", ["--lr", "3e-4"], module=True)[1:]
['-m', 'turbotrain.comm.launch', '--nproc-per-node=2', '--nnodes=1', '-m', 'my_project.train', '--lr', '3e-4']
"""

from __future__ import annotations

import datetime
import socket
import sys
from pathlib import Path
from typing import Sequence

from ..errors import ConfigError

__all__ = ["torchrun_command", "loopback_store", "main", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


def torchrun_command(nproc: int, target: str, target_args: Sequence[str] = (), *, module: bool = False,
                     nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                     master_port: int = 29500) -> list[str]:
    """The command that runs ``target`` (a script path, or a module name with ``module=True``) on
    ``nproc`` processes per node: through this module on one node, through torchrun on several.

    Raises ConfigError before anything starts: counts below 1, several nodes without
    ``master_addr``, or a script that does not exist.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be an integer >= 1: processes to start on this node")
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ConfigError(f"--nnodes {nnodes} must be an integer >= 1")
    if not module and not Path(target).is_file():
        raise ConfigError(f"script {target!r} does not exist; give the path of a Python file, "
                          "or -m for a module name")
    if nnodes == 1 and master_addr is None:
        cmd = [sys.executable, "-m", __name__, f"--nproc-per-node={nproc}", "--nnodes=1"]
    elif master_addr is None:
        raise ConfigError(f"--nnodes {nnodes} needs --master-addr (host of node 0) and --node-rank on every node")
    else:
        if not 0 <= node_rank < nnodes:
            raise ConfigError(f"--node-rank {node_rank} must be in [0, {nnodes - 1}] for --nnodes {nnodes}")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}",
               f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
    return cmd + (["-m"] if module else []) + [target, *target_args]


def loopback_store(timeout_s: float = 900.0):
    """A TCPStore server listening on 127.0.0.1 only, on a port the kernel picked; keep it alive
    while torchrun runs (torchrun's own store on that port reuses its server)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    # The store owns the descriptor from here on: detach() so Python's socket does not close it.
    return dist.TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                         master_listen_fd=sock.detach(), timeout=datetime.timedelta(seconds=timeout_s))


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m turbotrain.comm.launch [torchrun options] script ...``: torchrun on one node,
    its rendezvous on loopback. Exits as torchrun does (ChildFailedError when a rank fails)."""
    from torch.distributed import run

    argv = list(sys.argv[1:] if argv is None else argv)
    store = loopback_store()
    try:
        # static rendezvous on the store above; torchrun options given later in argv win (last one
        # counts), so these go first, and whoever overrides them gives up the loopback binding
        run.main(["--rdzv-backend=static", f"--master-addr={LOOPBACK}", f"--master-port={store.port}", *argv])
    finally:
        del store


if __name__ == "__main__":
    main()
