#!/bin/sh
# Every lever against the unchanged row, allocator tuned for both arms (as --malloc-tuned), one lock held.
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=536870912
for arm in merge unfuse chunk2048 u20 bind; do
  flock /tmp/tt-cpu.lock python ab2.py gpt 16 2 base $arm 2>&1 | grep -v "USDT\|Warn" > ab-$arm.log
done
