#!/usr/bin/env bash
# iperf3 TCP through a pair of userspace WireGuard devices in two throwaway network
# namespaces joined by a veth pair, both ends configured with `wg set` and `ip` only.
#
#   scripts/wg-pair-iperf.sh IMPL_A IMPL_B [SECONDS]     IMPL: wirespan | wireguard-go
#
# Prints the received rate from A to B and back (iperf3 -R). The wirespan binary is
# $WIRESPAN_BIN (default target/debug/wirespan). Needs root, wg, iperf3 and, for that
# implementation, wireguard-go. The namespaces and everything in them are removed on
# exit. A quick look, not the benchmark: `wirespan bench throughput` is that.
set -euo pipefail

impl_a="${1:?usage: $0 IMPL_A IMPL_B [SECONDS]}"
impl_b="${2:?usage: $0 IMPL_A IMPL_B [SECONDS]}"
secs="${3:-5}"
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${WIRESPAN_BIN:-$root/target/debug/wirespan}"

a="wspair-a-$$"
b="wspair-b-$$"
ip netns add "$a"
ip netns add "$b"
cleanup() {
	for n in "$a" "$b"; do
		ip netns pids "$n" 2>/dev/null | xargs -r kill -TERM 2>/dev/null || true
	done
	sleep 0.5
	for n in "$a" "$b"; do
		ip netns pids "$n" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
		ip netns del "$n" 2>/dev/null || true
	done
}
trap cleanup EXIT

ip link add "va$$" type veth peer name "vb$$"
ip link set "va$$" netns "$a"
ip link set "vb$$" netns "$b"
ip -n "$a" addr add 192.168.78.1/24 dev "va$$"
ip -n "$b" addr add 192.168.78.2/24 dev "vb$$"
for n in "$a" "$b"; do ip -n "$n" link set lo up; done
ip -n "$a" link set "va$$" up
ip -n "$b" link set "vb$$" up

start() { # NETNS IMPL IFNAME
	case "$2" in
	wirespan) ip netns exec "$1" "$bin" wireguard "$3" ;;
	wireguard-go) ip netns exec "$1" wireguard-go "$3" ;;
	*) echo "unknown implementation $2" >&2; exit 2 ;;
	esac
}
start "$a" "$impl_a" "wpa$$"
start "$b" "$impl_b" "wpb$$"

ka="$(wg genkey)"
kb="$(wg genkey)"
ip netns exec "$a" wg set "wpa$$" private-key <(echo "$ka") listen-port 51820 \
	peer "$(echo "$kb" | wg pubkey)" allowed-ips 10.8.0.2/32 endpoint 192.168.78.2:51821
ip netns exec "$b" wg set "wpb$$" private-key <(echo "$kb") listen-port 51821 \
	peer "$(echo "$ka" | wg pubkey)" allowed-ips 10.8.0.1/32 endpoint 192.168.78.1:51820
ip -n "$a" addr add 10.8.0.1/24 dev "wpa$$"
ip -n "$b" addr add 10.8.0.2/24 dev "wpb$$"
ip -n "$a" link set "wpa$$" up
ip -n "$b" link set "wpb$$" up
ip netns exec "$a" ping -c 1 -W 3 10.8.0.2 >/dev/null
ip netns exec "$b" iperf3 -s -D -B 10.8.0.2
for _ in $(seq 50); do
	ip netns exec "$b" ss -ltn | grep -q '10.8.0.2:5201' && break
	sleep 0.1
done

for dir in "" "-R"; do
	rate="$(ip netns exec "$a" iperf3 -c 10.8.0.2 -t "$secs" -J $dir |
		python3 -c 'import json,sys; print(round(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e6))')"
	if [ -z "$dir" ]; then what="$impl_a -> $impl_b"; else what="$impl_b -> $impl_a"; fi
	echo "$what: $rate Mbit/s"
done
