#!/usr/bin/env bash
# The suite's VM tier: the kernel-dependent tests again, inside one QEMU guest running
# Debian's 6.1 kernel (scripts/vm.sh): kernel WireGuard instead of wireguard-go, the
# fast path's clsact/cls_bpf attach instead of tcx, and the end-to-end lab scenarios on
# kernel WireGuard. The test binaries are the ones the host run built (nextest reuses
# them: no build in the guest). scripts/test.sh runs it after the host run; alone it
# needs those binaries built (`cargo nextest run --no-run --workspace`).
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/vm
cargo metadata --format-version 1 --locked >target/vm/cargo-metadata.json
# --workspace: the host run's own build (with -p, cargo's feature set differs and it
# would rebuild the crates).
cargo nextest list --workspace --locked --list-type binaries-only --message-format json \
  >target/vm/binaries.json

# What runs in the guest:
# - the backend-independent WireGuard tests on the kernel backend (wireguard-go's own
#   supervisor and adoption tests stay on the host), the fast-path attach tests
#   (clsact) and the WireGuard parity test;
# - the labs on kernel WireGuard: a mixed lab (kernel and wireguard-go side by side),
#   and the end-to-end scenarios: killed peer and bypass, restart with kernel state
#   kept, endpoint rotation, relay through a peer, the eBPF fast path, chaos (60 s
#   and at least four faults);
# - `wirespan wireguard` paired with kernel WireGuard, configured by `wg` and `ip` only
#   (ping and iperf3 both ways; skipped on the host, whose kernel has no WireGuard).
filter='
  (binary_id(wirespan-dataplane::wireguard)
     & !test(supervisor_restarts) & !test(a_kept_wireguard_go) & !test(steady_state))
  | binary_id(wirespan-dataplane::fastpath_attach)
  | (binary_id(wirespan-dataplane::parity) & test(wireguard))
  | (binary_id(wirespan::lab_cli) & test(mixed_lab))
  | (binary_id(wirespan::e2e_mesh) & (test(a_killed_peer_leaves) | test(a_restart_with_kernel_state_kept)
       | test(first_endpoint_is_blackholed) | test(ebpf_fast_path_marks)))
  | (binary_id(wirespan::lab_nat) & test(a_blocked_pair_in_a_topology_file))
  | binary_id(wirespan::lab_chaos)
  | (binary_id(wirespan::userspace_wireguard) & test(pairs_with_kernel_wireguard))'
# WIRESPAN_VM_TIER_ONLY narrows the run to the tests that also match this filter (to
# try one test in the VM).
if [ -n "${WIRESPAN_VM_TIER_ONLY:-}" ]; then
  filter="($filter) & (${WIRESPAN_VM_TIER_ONLY})"
fi

# Held open in the guest (scripts/vm.sh --cache): the binaries every test execs again
# and again, and their libraries. Under TCG, reading them from the host at each exec
# was most of a lab's time.
cache=(target/debug/wirespan)
while IFS= read -r bin; do cache+=("$bin"); done < <(python3 -c '
import json, sys
wanted = {"wirespan-dataplane::wireguard", "wirespan-dataplane::fastpath_attach",
          "wirespan-dataplane::parity", "wirespan::lab_cli", "wirespan::e2e_mesh",
          "wirespan::lab_nat", "wirespan::lab_chaos", "wirespan::userspace_wireguard"}
bins = json.load(open("target/vm/binaries.json"))["rust-binaries"].values()
for b in bins:
    if b["binary-id"] in wanted:
        print(b["binary-path"])
')
cache+=("$(rustup which cargo 2>/dev/null || command -v cargo)")
tools=(cargo cargo-nextest bash ip nft wg ping nsenter unshare sysctl curl cat wireguard-go iperf3)
for t in "${tools[@]}"; do
  p=$(command -v "$t") || continue
  cache+=("$p")
done
while IFS= read -r lib; do cache+=("$lib"); done < <(
  for f in "${cache[@]}"; do ldd "$f" 2>/dev/null || true; done \
    | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u)
cache_args=()
for f in "${cache[@]}"; do cache_args+=(--cache "$f"); done

started=$(date +%s)
set +e
# Chaos: 60 s of faults as the issue asks (the host run has 45 s); under TCG a
# fault's recovery may take longer than the host's 60 s.
WIRESPAN_TEST_WIREGUARD=kernel WIRESPAN_TEST_CHAOS_SECS=60 WIRESPAN_TEST_CHAOS_RECOVERY_SECS=180 \
  timeout --kill-after=30s 40m bash scripts/vm.sh --cpus 2 --memory 4G "${cache_args[@]}" -- \
  cargo nextest run --profile vm --binaries-metadata target/vm/binaries.json \
  --cargo-metadata target/vm/cargo-metadata.json --no-fail-fast -E "$filter"
status=$?
set -e
echo "vm tier: $(( $(date +%s) - started )) s wall, exit status $status" >&2
exit "$status"
