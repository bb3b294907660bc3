#!/usr/bin/env bash
# Run a command inside a private network namespace whose loopback is shaped like a slow link.
#
#   sudo bash src/turbotrain/bench/data/shape-link.sh --rate 1gbit -- .venv/bin/turbotrain comm-bench --nproc 2 --backend gloo
#
# Shipped as package data: `turbotrain bench --nproc 2 --link 1gbit` runs every job through it
# (found with turbotrain.bench.dp_ladder.shape_link_script()).
#
# Why a namespace's own loopback and no veth pair: the ranks of a data-parallel job on one box
# talk over 127.0.0.1, so shaping that namespace's `lo` shapes exactly their traffic, needs no
# addresses outside 127.0.0.0/8, and leaves the host's network untouched. The namespace, and
# with it the qdisc, is deleted on exit, also on Ctrl-C or failure.
#
# --no-shape: the same private namespace with its loopback left as it is. The ladder runs its
# plain-loopback jobs that way too, so every job's traffic (and nothing else) crosses one `lo`
# whose transmit counter it can read.
#
# Caveat: on loopback every byte crosses the one shaped egress once, so the rate is shared by
# both directions, like a half-duplex link (a real full-duplex 1 Gbit/s NIC carries 1 each way).
set -euo pipefail

rate="1gbit"
delay=""
shape=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;   # one-way added latency, e.g. 100us (netem)
    --no-shape) shape=0; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "shape-link.sh: unknown option $1 (use --rate R --delay D | --no-shape -- command...)" >&2; exit 2 ;;
  esac
done
[[ $# -gt 0 ]] || { echo "shape-link.sh: give the command to run after --" >&2; exit 2; }
[[ $EUID -eq 0 ]] || { echo "shape-link.sh: needs root (ip netns, tc); run it with sudo" >&2; exit 1; }
command -v ip >/dev/null && command -v tc >/dev/null || {
  echo "shape-link.sh: needs ip and tc (apt-get install iproute2)" >&2; exit 1; }

ns="turbotrain-shaped-$$"
cleanup() { ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

ip netns add "$ns"
ip netns exec "$ns" ip link set lo up
if [[ $shape -eq 0 ]]; then
  echo "shape-link.sh: namespace $ns, lo unshaped" >&2
  ip netns exec "$ns" "$@"
  exit $?
fi
# burst must hold at least one loopback MTU (64 KiB) or tbf drops every full-size packet.
if [[ -n "$delay" ]]; then
  ip netns exec "$ns" tc qdisc add dev lo root handle 1: netem delay "$delay"
  ip netns exec "$ns" tc qdisc add dev lo parent 1: handle 2: tbf rate "$rate" burst 256kb latency 50ms
else
  ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 256kb latency 50ms
fi
echo "shape-link.sh: namespace $ns, lo shaped to $rate${delay:+, +$delay delay}:" >&2
ip netns exec "$ns" tc qdisc show dev lo >&2
ip netns exec "$ns" "$@"
