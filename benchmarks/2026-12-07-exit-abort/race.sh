mode=$1; s=$2; n=$3
for i in $(seq $n); do
  port=$((20000 + RANDOM % 20000))
  for r in 0 1; do RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port /work/main/.venv/bin/python race.py $mode $s > race-$r.txt 2>&1 & eval "p$r=\$!"; done
  wait $p0; c0=$?; wait $p1; c1=$?; echo -n "$c0/$c1 "
done; echo
