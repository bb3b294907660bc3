"""Two-process interleaved A/B on the tied functional GPT (nn.RMSNorm), tt-fused-compile:
'new' lists torch.rms_norm in the FP32 keep-list (bc46d0e), 'old' takes it out again (as before).
usage: ab_rms.py ROUNDS STEPS_PER_ROUND"""
import os, sys, time, random, statistics, multiprocessing as mp


def worker(arm, conn):
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-07-user-code-patterns-2"))
    from turbotrain.precision import keep_fp32
    if arm == "old":
        keep_fp32.RETURN_INPUT_DTYPE.discard(torch.rms_norm)
    import turbotrain
    from functional_gpt import build, batches, lm_loss
    torch.set_num_threads(2)
    eng = turbotrain.Engine(build(), lambda p: torch.optim.AdamW(p, lr=3e-4, fused=True), lm_loss,
                            config=turbotrain.Config(precision="auto", fuse=True, compile=True))
    data = batches(200, 0)
    it = iter(data)
    losses = [float(eng.step(next(it)).loss) for _ in range(3)]
    conn.send("ready")
    while True:
        n = conn.recv()
        if n == 0:
            break
        ts = []
        for _ in range(n):
            b = next(it); t = time.perf_counter(); losses.append(float(eng.step(b).loss)); ts.append(time.perf_counter() - t)
        conn.send(ts)
    conn.send(losses)


if __name__ == "__main__":
    rounds, spr = int(sys.argv[1]), int(sys.argv[2])
    ctx = mp.get_context("spawn")
    arms = ("old", "new")
    pipes = {}
    for a in arms:
        parent, child = ctx.Pipe()
        ctx.Process(target=worker, args=(a, child), daemon=True).start()
        pipes[a] = parent
    for a in arms:
        assert pipes[a].recv() == "ready"
    med = {a: [] for a in arms}
    for r in range(rounds):
        for a in (arms if r % 2 == 0 else arms[::-1]):
            pipes[a].send(spr)
            med[a].append(statistics.median(pipes[a].recv()))
        print(f"round {r}: old {med['old'][-1]:.3f} s  new {med['new'][-1]:.3f} s", flush=True)
    for a in arms:
        pipes[a].send(0)
    losses = {a: pipes[a].recv() for a in arms}
    ratios = [o / n for o, n in zip(med["old"], med["new"])]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    print(f"old / new step time, per-round median {statistics.median(ratios):.3f} "
          f"(95% {boots[50]:.3f}-{boots[1949]:.3f}); old {statistics.median(med['old']):.3f} s, "
          f"new {statistics.median(med['new']):.3f} s")
    print("last losses old", [round(x, 4) for x in losses["old"][-3:]], "new", [round(x, 4) for x in losses["new"][-3:]])
