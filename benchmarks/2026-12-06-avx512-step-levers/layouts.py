import torch, time, itertools
torch.manual_seed(0)
def bench(f):
    for _ in range(3): f()
    r = []
    for _ in range(15):
        t = time.perf_counter(); f(); r.append(time.perf_counter() - t)
    r.sort(); return r[len(r)//2]
for M, K, N in [(2048, 512, 512), (2048, 512, 2048), (2048, 2048, 512), (512, 2048, 512), (512, 2048, 2048), (512, 512, 8192), (8192, 512, 512), (512, 8192, 512)]:
    row = []
    for ta, tb in itertools.product((False, True), repeat=2):
        A = torch.randn(K, M).bfloat16().t() if ta else torch.randn(M, K).bfloat16()
        B = torch.randn(N, K).bfloat16().t() if tb else torch.randn(K, N).bfloat16()
        s = bench(lambda: torch.mm(A, B))
        row.append(f"{'T' if ta else 'N'}{'T' if tb else 'N'} {2*M*K*N/s/1e9:5.0f}")
    print(f"M{M:5d} K{K:5d} N{N:5d}: " + "  ".join(row), flush=True)
