"""Two-process interleaved A/B of tt-fused-compile levers: each arm in its own worker, a round of steps each in turn,
order alternating; per-round median ratio with a 95% bootstrap interval.
usage: ab2.py WORKLOAD[@T][:padded] ROUNDS STEPS_PER_ROUND ARM_A ARM_B
arms: base | merge | unfuse | chunkN (head chunk rows) | u20 (Inductor exp -> exp_u20) | bind (OMP_PROC_BIND) |
      active (OMP_WAIT_POLICY) | plain / stock (Config(attention=...))
:padded: HF batches right-padded, row r of a batch losing r/16 of its tail (labels -100 there)."""
import sys, time, statistics, multiprocessing as mp
def worker(arm, wl_name, conn):
    import os
    if arm == "bind":
        os.environ["OMP_PROC_BIND"] = "true"; os.environ["OMP_PLACES"] = "cores"
    if arm == "active":
        os.environ["OMP_WAIT_POLICY"] = "active"
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch._inductor import config as ic
    from passes import Merge, Unfuse, STATS
    if arm == "merge":  # read from the global config when Inductor compiles
        ic.pre_grad_custom_pass = Merge()
    if arm == "unfuse":  # the Engine composes a user's post-grad pass with its own when it compiles
        ic.post_grad_custom_post_pass = Unfuse()
    if arm.startswith("chunk"):
        import importlib
        L = importlib.import_module("turbotrain.fusion.ops.linear_cross_entropy")
        c = int(arm[5:]); L.default_chunk_rows = lambda rows, *a, **k: min(c, rows)
    if arm == "u20":
        from torch._inductor.codegen import cpp as C
        ic.fx_graph_cache = False
        import torch._functorch.config as fc; fc.enable_autograd_cache = False
        C.CppVecOverrides.exp = staticmethod(lambda x: f"{x}.exp_u20()")
    from turbotrain.bench.tt import EngineTrainer
    from turbotrain.workloads import get_workload
    spec, _, pad = wl_name.partition(":")
    name, _, T = spec.partition("@")
    wl = get_workload(name, **({"T": int(T)} if T else {}))
    torch.manual_seed(0)
    tr = EngineTrainer(wl, "cpu", precision="bf16-master", fuse=("linear_cross_entropy",), compile=True,
                       attention=arm if arm in ("stock", "plain") else "auto")
    def padded(b):
        b = dict(b); m = b["attention_mask"].clone(); lab = b["labels"].clone(); n = m.shape[1]
        for r in range(m.shape[0]):
            keep = n - (r * n // 16); m[r, keep:] = 0; lab[r, keep:] = -100
        b["attention_mask"] = m; b["labels"] = lab
        return b
    it = wl.batches("train", seed=0)
    if pad == "padded":
        it = map(padded, it)
    losses = [float(tr.step(next(it))) for _ in range(3)]
    print(arm, "pass stats", dict(STATS), flush=True)
    conn.send("ready")
    while True:
        n = conn.recv()
        if n == 0: break
        ts = []
        for _ in range(n):
            b = next(it); t = time.perf_counter(); losses.append(float(tr.step(b))); ts.append(time.perf_counter() - t)
        conn.send(ts)
    conn.send(losses)
if __name__ == "__main__":
    wl, rounds, spr, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    ctx = mp.get_context("spawn")
    arms = {}
    for arm in (a, b):
        p, c = ctx.Pipe(); pr = ctx.Process(target=worker, args=(arm, wl, c)); pr.start(); assert p.recv() == "ready"; arms[arm] = (pr, p)
    times = {a: [], b: []}
    for r in range(rounds):
        for arm in ((a, b) if r % 2 == 0 else (b, a)):
            arms[arm][1].send(spr); times[arm].append(statistics.median(arms[arm][1].recv()))
    for arm, (pr, p) in arms.items():
        p.send(0); l = p.recv(); pr.join()
        print(arm, f"median {statistics.median(times[arm]):.4f}", "losses", [round(x, 4) for x in l[-3:]])
    ratios = sorted(x / y for x, y in zip(times[a], times[b]))
    import random
    random.seed(0); bs = sorted(statistics.median(random.choices(ratios, k=len(ratios))) for _ in range(2000))
    print(f"{a}/{b} per-round (>1: {b} faster) median {statistics.median(ratios):.3f} 95% [{bs[50]:.3f}, {bs[1949]:.3f}]", [round(x, 3) for x in ratios])
