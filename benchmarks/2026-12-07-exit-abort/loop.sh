#!/bin/bash
# usage: loop.sh N mode...
N=$1; shift
cd /tmp/flake
for i in $(seq $N); do
  for mode in "$@"; do
    port=$((20000 + RANDOM % 20000))
    for r in 0 1; do
      RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port PYTHONFAULTHANDLER=1 \
        /work/main/.venv/bin/python rank.py $mode > log-$mode-$i-$r.txt 2>&1 &
      eval "p$r=\$!"
    done
    wait $p0; c0=$?; wait $p1; c1=$?
    echo "$i $mode $c0 $c1"
  done
done
