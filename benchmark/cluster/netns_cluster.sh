#!/usr/bin/env bash
# A cluster with a real network on one machine: N "nodes", each a network namespace
# with its own address on a private test subnet that exists only inside the
# namespaces this script creates, joined by veth links to a bridge namespace; every
# link shaped with tc (tbf: the kernels here have no netem, so no delay) in both
# directions. One torchrun agent runs in each node's namespace (rendezvous over the
# nodes' addresses, gloo on the node's interface); ranks of one node talk over its
# own stack, ranks of two nodes over the shaped links. The namespaces are removed on
# every exit (trap), and a run is bounded in time.
#
# Needs root and iproute2 (ip, tc). Usage:
#   bash benchmark/cluster/netns_cluster.sh [--nodes 2] [--ranks-per-node 1] \
#       [--rate 1gbit] [--prefix dembc] [--time-limit 600] -- SCRIPT.py [ARGS...]
# Prints each node's link bytes (sent, received) after the run:
#   "node <i> link bytes: tx <n> rx <n>".
set -euo pipefail

NODES=2 RANKS=1 RATE=1gbit PREFIX=dembc LIMIT=600 SUBNET=10.77.0
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES=$2; shift 2 ;;
        --ranks-per-node) RANKS=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --prefix) PREFIX=$2; shift 2 ;;
        --time-limit) LIMIT=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "netns_cluster.sh: unknown option $1 (see the header for the usage)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "netns_cluster.sh: give the job after -- (a script and its args)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "netns_cluster.sh: needs root (network namespaces, tc)" >&2; exit 3; }
for tool in ip tc; do
    command -v "$tool" >/dev/null || { echo "netns_cluster.sh: needs iproute2 ($tool missing)" >&2; exit 3; }
done
[[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,7}$ ]] || { echo "netns_cluster.sh: --prefix: 1-8 lowercase letters/digits" >&2; exit 2; }
[ "$NODES" -ge 2 ] && [ "$NODES" -le 16 ] || { echo "netns_cluster.sh: --nodes 2..16" >&2; exit 2; }
PY=${PYTHON:-$(command -v python3)}
BRIDGE="$PREFIX-br"

cleanup() {
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-(br|n[0-9]+)$" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
}
trap cleanup EXIT INT TERM
cleanup  # idempotent: a run that was killed left nothing behind either

shape() {  # namespace, device: tbf at the link rate on its egress
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$RATE" burst 256kb latency 100ms
}

ip netns add "$BRIDGE"
ip -n "$BRIDGE" link add br0 type bridge
ip -n "$BRIDGE" link set br0 up
for i in $(seq 0 $((NODES - 1))); do
    ns="$PREFIX-n$i"
    ip netns add "$ns"
    ip link add "${PREFIX}v$i" type veth peer name "${PREFIX}p$i"
    ip link set "${PREFIX}v$i" netns "$ns" name eth0
    ip link set "${PREFIX}p$i" netns "$BRIDGE"
    ip -n "$BRIDGE" link set "${PREFIX}p$i" master br0 up
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    shape "$ns" eth0                   # what the node sends
    shape "$BRIDGE" "${PREFIX}p$i"     # what it receives
done

PORT=$((20000 + RANDOM % 20000))
pids=()
for i in $(seq 0 $((NODES - 1))); do
    ip netns exec "$PREFIX-n$i" env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
        timeout --kill-after=10 "$LIMIT" "$PY" -m torch.distributed.run \
        --nnodes "$NODES" --node_rank "$i" --nproc_per_node "$RANKS" \
        --master_addr "$SUBNET.1" --master_port "$PORT" --max_restarts 0 "$@" &
    pids+=($!)
done
status=0
while [ ${#pids[@]} -gt 0 ]; do  # the first node that fails stops the others
    if wait -n "${pids[@]}"; then :; else status=$?; kill "${pids[@]}" 2>/dev/null || true; fi
    alive=()
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
    pids=("${alive[@]+"${alive[@]}"}")
done
for i in $(seq 0 $((NODES - 1))); do
    stats="/sys/class/net/eth0/statistics"
    tx=$(ip netns exec "$PREFIX-n$i" cat "$stats/tx_bytes")
    rx=$(ip netns exec "$PREFIX-n$i" cat "$stats/rx_bytes")
    echo "node $i link bytes: tx $tx rx $rx"
done
exit $status
