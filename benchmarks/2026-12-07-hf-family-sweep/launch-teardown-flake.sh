fa=0; fb=0
for i in $(seq 1 30); do
  for arm in a b; do
    OMP_NUM_THREADS=1 timeout 200 /tmp/fresh16/.venv/bin/turbotrain launch --nproc 2 /tmp/pt_$arm.py --mode fsdp --model gpt > /tmp/flake_${arm}_$i.txt 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then [ $arm = a ] && fa=$((fa+1)) || fb=$((fb+1)); echo "run $i arm $arm rc=$rc"; fi
  done
done
echo "fails a=$fa/30 b=$fb/30"
