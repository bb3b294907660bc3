#!/usr/bin/env bash
# The one script a GPU session runs: the CUDA paths the CPU suite cannot exercise (Triton kernels at
# odd shapes, fp16 loss scaling through the fused head, NCCL + DDP with every compression and
# SyncBatchNorm, the quick bench ladder on cuda, FSDP2 with bf16 and a sharded checkpoint on
# NCCL). Output format: docs/gpu-check.md.
#
#   bash scripts/gpu-check.sh          (PYTHON=/path/to/python to choose the interpreter)
#
# Every stage runs under its own `timeout`; with the probes they sum to 473 s (10 + 30 + 15 + 150
# + 70 + 60 + 80 + 40, plus 3 s of kill grace for each of the 6 stages), so the whole script ends
# in under 8 minutes. A stage that fails or times out is reported and the next one still runs.
# Nothing is installed: the interpreter must already have torch (CUDA build), pytest and, for the
# fused kernels, triton. Exit status: 0 no stage failed, 1 some failed, 2 no usable GPU here.
set -uo pipefail
cd "$(dirname "$0")/.."

# -- 1. Is there a GPU at all? Before anything slow, so a CPU machine gets one line and exit 2. ----
gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(timeout 10 nvidia-smi -L 2>/dev/null)
fi
if ! grep -q '^GPU ' <<<"$gpus"; then
    echo "gpu-check: needs an NVIDIA GPU and this machine has none (nvidia-smi finds no GPU); nothing was run"
    exit 2
fi
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# One interpreter start answers everything the stages need to know: CUDA? GPUs? turbotrain? triton?
PROBE='
import importlib.util, torch
print(torch.cuda.is_available(), torch.cuda.device_count(), torch.__version__,
      importlib.util.find_spec("turbotrain") is not None, importlib.util.find_spec("triton") is not None)'
if ! probe=$(timeout 30 "$PY" -c "$PROBE" 2>&1); then
    echo "gpu-check: needs a python with torch ($PY could not import it: ${probe##*$'\n'}); nothing was run"
    exit 2
fi
read -r HAS_CUDA NGPU TORCH HAS_TT HAS_TRITON <<<"${probe##*$'\n'}"
if [ "$HAS_CUDA" != "True" ]; then
    echo "gpu-check: needs a GPU that torch can use; torch $TORCH with $PY sees none (a CPU-only build?); nothing was run"
    exit 2
fi
if [ "$HAS_TT" != "True" ]; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # run from the checkout, not installed
fi
TRITON_NOTE=""
if [ "$HAS_TRITON" != "True" ]; then
    TRITON_NOTE="; triton is missing, so the fused ops' CUDA kernels cannot run (use a torch CUDA build that ships it)"
fi

OUT=bench-out/gpu-check
mkdir -p "$OUT"
: >"$OUT/summary.tsv"
STAGES=()
START=$SECONDS

# record NAME STATUS SECONDS NOTE: one status line now, one row of the summary at the end.
record() {
    STAGES+=("$1")
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$OUT/summary.tsv"
    echo "gpu-check: stage=$1 status=$2 seconds=$3 note=\"$4\""
}

# run_stage NAME LIMIT_S NOTE_FN COMMAND...: run with a hard limit, log to $OUT/NAME.log, record it.
# NOTE_FN prints the note from the log (and may print SKIP on its first line to mark a skip).
run_stage() {
    local name=$1 limit=$2 note_fn=$3 t0=$SECONDS rc status note
    shift 3
    echo "== $name (limit ${limit}s, log $OUT/$name.log)"
    printf '$ %s\n' "$*" >"$OUT/$name.log"
    timeout -k 3 "$limit" "$@" >>"$OUT/$name.log" 2>&1
    rc=$?
    note=$("$note_fn" "$OUT/$name.log")
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status=TIMEOUT note="killed after ${limit}s; $note"
    elif [ "${note%% *}" = "SKIP" ]; then
        status=SKIP note=${note#SKIP }
    elif [ $rc -eq 0 ]; then
        status=PASS
    else
        status=FAIL note="exit $rc; $note"
    fi
    if [ "$status" = FAIL ] || [ "$status" = TIMEOUT ]; then
        tail -n 25 "$OUT/$name.log" | sed 's/^/    | /'
    fi
    record "$name" "$status" $((SECONDS - t0)) "$note"
}

pytest_note() {  # pytest's own last line, e.g. "52 passed, 1 skipped in 81.20s"; SKIP if none ran
    local line skip=""
    line=$(grep -E ' in [0-9.]+s( \([0-9:]+\))?( =+)?$' "$1" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    if [[ "$line" == *skipped* && "$line" != *passed* && "$line" != *failed* && "$line" != *error* ]]; then
        skip="SKIP "  # every test skipped: nothing was checked, so it cannot count as a pass
    fi
    echo "${skip}${line:-no pytest summary (see $1)}${TRITON_NOTE}"
}
ddp_note() {  # the worker's RESULT or SKIP line
    local line
    line=$(grep -E '^gpu-check-ddp: (RESULT|SKIP)' "$1" | tail -n 1 | sed 's/^gpu-check-ddp: //; s/^RESULT //')
    echo "${line:-no result line from the ranks (see $1)}"
}
fsdp_note() {  # the RESULT line (a SKIP only if no run got as far); says when it fell back to one rank
    local line fallback=""
    line=$(grep -E '^gpu-check-fsdp: RESULT' "$1" | tail -n 1 | sed 's/^gpu-check-fsdp: RESULT //')
    if grep -q '^gpu-check-fsdp: NOTE' "$1"; then
        fallback="; NCCL refused 2 ranks on one GPU, so checked on 1 rank"
    fi
    if [ -z "$line" ] && [ -z "$fallback" ]; then
        line=$(grep -E '^gpu-check-fsdp: SKIP' "$1" | tail -n 1 | sed 's/^gpu-check-fsdp: //')
    fi
    echo "${line:-no result line from the ranks (see $1)}${fallback}"
}
bench_note() {
    if [ -f bench-out/gpu-quick/results.json ]; then echo "rows in bench-out/gpu-quick/results.json"; else echo "no results.json (see $1)"; fi
}
tail_note() { tail -n 1 "$1"; }

# -- 2. The environment, recorded first (it goes at the top of any benchmarks/ entry). -----------
ENV_PY='
import importlib.util, torch, torch.distributed as dist
name, cap = torch.cuda.get_device_name(), ".".join(map(str, torch.cuda.get_device_capability()))
nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
triton = __import__("triton").__version__ if importlib.util.find_spec("triton") else "missing"
print(f"{torch.cuda.device_count()}x {name} (capability {cap}), torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, NCCL {nccl}, triton {triton}")'
run_stage env 15 tail_note "$PY" -c "$ENV_PY"

# -- 3. CUDA-marked tests: fused ops at odd widths, fp16/bf16, bias, non-contiguous, multi-block
#       vocabularies; precision modes and the loss scaler. --------------------------------------
FP16_CE=tests/test_cuda_precision.py::test_fp16_master_fused_cross_entropy_lets_the_scale_grow_past_2_16
run_stage cuda-tests 150 pytest_note "$PY" -m pytest -q -m cuda -p no:cacheprovider \
    tests/test_cuda_fusion.py tests/test_cuda_precision.py --deselect "$FP16_CE"

# -- 4. fp16-master with the fused cross-entropy for 50 steps: the scale must grow past 2**16. ---
run_stage fp16-fused-ce 70 pytest_note "$PY" -m pytest -q -m cuda -p no:cacheprovider "$FP16_CE"

# -- 5. NCCL: Engine + DDP with each compression and SyncBatchNorm, two ranks (one per GPU, or both
#       on one GPU where NCCL allows it; scripts/gpu-check-ddp.py says SKIP where it does not). ---
NPROC=$(( NGPU >= 2 ? NGPU : 2 ))
run_stage nccl-ddp 60 ddp_note "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
    scripts/gpu-check-ddp.py

# -- 6. The quick bench ladder on cuda (tiny gpt, 4 rows, each its own process). ---------------
rm -rf bench-out/gpu-quick  # so the note cannot point at an older run's results
# the `turbotrain` entry point, called through $PY so no installed console script is needed
TT_CLI='import sys; from turbotrain.cli import main; sys.exit(main())'
run_stage bench-quick 80 bench_note "$PY" -c "$TT_CLI" bench --workload gpt --quick --device cuda \
    --strict --out bench-out/gpu-quick

# -- 7. FSDP2 on NCCL: Engine + Config(parallel=ParallelConfig()) in bf16-master for 20 steps, then a
#       sharded save loaded into a fresh Engine; one rank per GPU (2 on one GPU, or 1 rank where NCCL
#       refuses two on one GPU: scripts/gpu-check-fsdp.py launches itself and falls back). ----------
run_stage fsdp2 40 fsdp_note "$PY" scripts/gpu-check-fsdp.py --nproc "$NPROC"

# -- Summary --------------------------------------------------------------------------------------
echo
echo "== gpu-check summary ($(tail_note "$OUT/env.log"))"
printf '%-14s %-9s %7s  %s\n' stage status seconds note
while IFS=$'\t' read -r name status secs note; do
    printf '%-14s %-9s %7s  %s\n' "$name" "$status" "$secs" "$note"
done <"$OUT/summary.tsv"
failed=$(cut -f2 "$OUT/summary.tsv" | grep -cE '^(FAIL|TIMEOUT)$')
echo "gpu-check: ${#STAGES[@]} stages, $failed failed or timed out, $((SECONDS - START)) s; logs in $OUT/"
[ "$failed" -eq 0 ]
