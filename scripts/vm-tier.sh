#!/usr/bin/env bash
# The suite's VM tier: the kernel-dependent tests again, inside one QEMU guest running
# Debian's 6.1 kernel (scripts/vm.sh): kernel WireGuard instead of wireguard-go, the
# fast path's clsact/cls_bpf attach instead of tcx. The test binaries are the ones the
# host run built (nextest reuses them: no build in the guest). scripts/test.sh runs it
# after the host run; alone it needs those binaries built (`cargo nextest run
# --no-run --workspace`).
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/vm
cargo metadata --format-version 1 --locked >target/vm/cargo-metadata.json
cargo nextest list -p wirespan-dataplane -p wirespan --locked --list-type binaries-only --message-format json \
  >target/vm/binaries.json

# What runs in the guest: the backend-independent WireGuard tests on the kernel
# backend (wireguard-go's own supervisor and adoption tests stay on the host), the
# fast-path attach tests (clsact) and the WireGuard parity test.
filter='
  (binary_id(wirespan-dataplane::wireguard)
     & !test(supervisor_restarts) & !test(a_kept_wireguard_go) & !test(steady_state))
  | binary_id(wirespan-dataplane::fastpath_attach)
  | (binary_id(wirespan-dataplane::parity) & test(wireguard))'
# WIRESPAN_VM_TIER_E2E=1 adds the labs: kernel WireGuard on every node, a mixed lab,
# and the end-to-end scenarios (killed peer and bypass, restart with kernel state
# kept, endpoint rotation, relay through a peer, the eBPF fast path, 60 s of chaos).
# Not in the default tier: under TCG on this loaded 2-core machine a lab did not come
# up within a test's 5 minutes.
if [ "${WIRESPAN_VM_TIER_E2E:-0}" = 1 ]; then
  filter+='
  | (binary_id(wirespan::lab_cli) & (test(kernel_wireguard) | test(mixed_lab)))
  | (binary_id(wirespan::e2e_mesh) & (test(a_killed_peer_leaves) | test(a_restart_with_kernel_state_kept)
       | test(first_endpoint_is_blackholed) | test(ebpf_fast_path_marks)))
  | (binary_id(wirespan::lab_nat) & test(a_blocked_pair_in_a_topology_file))
  | binary_id(wirespan::lab_chaos)'
fi

started=$(date +%s)
set +e
WIRESPAN_TEST_WIREGUARD=kernel WIRESPAN_TEST_CHAOS_SECS=60 \
  timeout --kill-after=30s 40m bash scripts/vm.sh --cpus 2 --memory 4G -- \
  cargo nextest run --binaries-metadata target/vm/binaries.json \
  --cargo-metadata target/vm/cargo-metadata.json --no-fail-fast -E "$filter"
status=$?
set -e
echo "vm tier: $(( $(date +%s) - started )) s wall, exit status $status" >&2
exit "$status"
