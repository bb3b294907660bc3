set -x
cd /tmp/fresh17
TT=.venv/bin/turbotrain
O=/tmp/ft
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=10000000000
grep -o 'avx512_bf16\|avx512f\|avx2\|amx_bf16' /proc/cpuinfo | sort | uniq -c
$TT env 2>&1 | head -30
flock /tmp/tt-cpu.lock $TT bench --workload gpt --configs torch-compile-step,tt-fused-compile --config-file $O/all-compile.json --steps 16 --rounds 8 --malloc-tuned --out $O/gpt-all-compile > $O/gpt-all-compile.txt 2>&1
flock /tmp/tt-cpu.lock $TT bench --workload gpt --configs torch-compile-step,tt-fused-compile --config-file $O/quickstart.json --steps 16 --rounds 8 --no-aa --malloc-tuned --out $O/gpt-quickstart > $O/gpt-quickstart.txt 2>&1
flock /tmp/tt-cpu.lock $TT bench --workload hf-llama --configs torch-compile-step,tt-fused-compile --config-file $O/all-compile.json --steps 16 --rounds 8 --no-aa --malloc-tuned --out $O/hf-llama-all-compile > $O/hf-llama-all-compile.txt 2>&1
flock /tmp/tt-cpu.lock $TT bench --workload hf-llama --configs tt-fuse-linear-cross-entropy,tt-fuse-all --reference tt-fuse-linear-cross-entropy --steps 16 --rounds 8 --no-aa --malloc-tuned --out $O/hf-llama-eager > $O/hf-llama-eager.txt 2>&1
flock /tmp/tt-cpu.lock $TT bench --workload user-gpt --configs torch-compile-step,tt-fused-compile --config-file $O/all-compile.json --steps 16 --rounds 8 --no-aa --malloc-tuned --out $O/user-gpt-all-compile > $O/user-gpt-all-compile.txt 2>&1
echo done
