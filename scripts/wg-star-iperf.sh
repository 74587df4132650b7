#!/usr/bin/env bash
# iperf3 TCP from two peers at once to one userspace WireGuard device: three throwaway
# network namespaces (hub H, spokes B and C) on one bridge, every device configured
# with `wg set` and `ip` only. B and C each send to H for SECONDS at the same time.
#
#   scripts/wg-star-iperf.sh HUB_IMPL SPOKE_IMPL [SECONDS]   IMPL: wirespan | wireguard-go
#
# Prints each sender's received rate and their sum. The wirespan binary is
# $WIRESPAN_BIN (default target/debug/wirespan). Needs root, wg and iperf3. The
# namespaces and everything in them are removed on exit. It shows whether the hub
# seals and opens two peers' packets at once; it is not the benchmark.
set -euo pipefail

hub_impl="${1:?usage: $0 HUB_IMPL SPOKE_IMPL [SECONDS]}"
spoke_impl="${2:?usage: $0 HUB_IMPL SPOKE_IMPL [SECONDS]}"
secs="${3:-5}"
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${WIRESPAN_BIN:-$root/target/debug/wirespan}"

tag="$$"
nodes=(h b c)
ns() { echo "wsstar-$1-$tag"; }
cleanup() {
	for n in "${nodes[@]}"; do
		ip netns pids "$(ns "$n")" 2>/dev/null | xargs -r kill -TERM 2>/dev/null || true
	done
	sleep 0.5
	for n in "${nodes[@]}"; do
		ip netns pids "$(ns "$n")" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
		ip netns del "$(ns "$n")" 2>/dev/null || true
	done
}
trap cleanup EXIT

ip netns add "$(ns br)"
nodes+=(br)
ip -n "$(ns br)" link add br0 type bridge
ip -n "$(ns br)" link set br0 up
declare -A under=([h]=1 [b]=2 [c]=3)
declare -A key
for n in h b c; do
	ip netns add "$(ns "$n")"
	ip link add "e$n$tag" type veth peer name "p$n$tag"
	ip link set "e$n$tag" netns "$(ns "$n")"
	ip link set "p$n$tag" netns "$(ns br)"
	ip -n "$(ns br)" link set "p$n$tag" master br0 up
	ip -n "$(ns "$n")" addr add "192.168.79.${under[$n]}/24" dev "e$n$tag"
	ip -n "$(ns "$n")" link set "e$n$tag" up
	ip -n "$(ns "$n")" link set lo up
	impl="$spoke_impl"
	[ "$n" = h ] && impl="$hub_impl"
	case "$impl" in
	wirespan) ip netns exec "$(ns "$n")" "$bin" wireguard "ws$n$tag" ;;
	wireguard-go) ip netns exec "$(ns "$n")" wireguard-go "ws$n$tag" 2>/dev/null ;;
	*) echo "unknown implementation $impl" >&2; exit 2 ;;
	esac
	key[$n]="$(wg genkey)"
done
pub() { echo "${key[$1]}" | wg pubkey; }
peer() { # NODE OTHER: the wg set arguments for OTHER as a peer of NODE
	echo peer "$(pub "$2")" allowed-ips "10.9.0.${under[$2]}/32" endpoint "192.168.79.${under[$2]}:5182${under[$2]}"
}
for n in h b c; do
	peers=()
	if [ "$n" = h ]; then read -ra peers <<<"$(peer h b) $(peer h c)"; else read -ra peers <<<"$(peer "$n" h)"; fi
	ip netns exec "$(ns "$n")" wg set "ws$n$tag" private-key <(echo "${key[$n]}") \
		listen-port "5182${under[$n]}" "${peers[@]}"
	ip -n "$(ns "$n")" addr add "10.9.0.${under[$n]}/24" dev "ws$n$tag"
	ip -n "$(ns "$n")" link set "ws$n$tag" up
done
for n in b c; do ip netns exec "$(ns "$n")" ping -c 1 -W 3 10.9.0.1 >/dev/null; done
for port in 5201 5202; do ip netns exec "$(ns h)" iperf3 -s -D -B 10.9.0.1 -p "$port"; done
for _ in $(seq 50); do
	[ "$(ip netns exec "$(ns h)" ss -ltn | grep -c '10.9.0.1:520[12]')" = 2 ] && break
	sleep 0.1
done
rate() { python3 -c 'import json,sys; print(round(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e6))'; }
ip netns exec "$(ns b)" iperf3 -c 10.9.0.1 -p 5201 -t "$secs" -J >"/tmp/wsstar-b-$tag.json" &
ip netns exec "$(ns c)" iperf3 -c 10.9.0.1 -p 5202 -t "$secs" -J >"/tmp/wsstar-c-$tag.json"
wait
rb="$(rate <"/tmp/wsstar-b-$tag.json")"
rc="$(rate <"/tmp/wsstar-c-$tag.json")"
rm -f "/tmp/wsstar-b-$tag.json" "/tmp/wsstar-c-$tag.json"
echo "B -> hub: $rb Mbit/s, C -> hub: $rc Mbit/s, sum: $((rb + rc)) Mbit/s"
