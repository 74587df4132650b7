#!/usr/bin/env bash
# The main job: a 3-node WireGuard mesh on this machine. Each node is a network
# namespace (with its own mount and UTS namespaces) on a simulated underlay, with a
# discovery server in a namespace of its own; nothing touches the host's network.
#
#   bash scripts/main.sh                      # up, status, ping matrix, then down
#   WIRESPAN_LAB_KEEP=1 bash scripts/main.sh  # keep the lab to look around
#   bash scripts/main.sh --nodes 8 --fast-path ebpf   # extra arguments go to `lab up`
#
# The lab is named by WIRESPAN_LAB (default `lab`); a leftover lab of that name (from a
# crash or an earlier kept run) is removed first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --locked
bin=${CARGO_TARGET_DIR:-$PWD/target}/release/wirespan

"$bin" lab down >/dev/null
if [ "${WIRESPAN_LAB_KEEP:-0}" != 1 ]; then
  trap '"$bin" lab down' EXIT
fi

if ! "$bin" lab up --nodes 3 --no-hints "$@"; then
  echo "main: the lab did not converge; its state:" >&2
  "$bin" lab status >&2 || true
  exit 1
fi
echo
"$bin" lab status

cat <<HINTS

Look around (as root):
  $bin lab status [-o json]                        # every node's peers and their state
  $bin lab exec node1 -- wirespan get peers        # any command inside a node
  $bin lab exec node1 -- wg show kubespan          # the node's WireGuard device
  $bin lab exec node2 -- ping -c1 10.99.1.11       # the underlay
  logs: /run/wirespan-lab/${WIRESPAN_LAB:-lab}/node*/node.log
Tear down:
  $bin lab down
HINTS
if [ "${WIRESPAN_LAB_KEEP:-0}" != 1 ]; then
  echo "main: removing the lab now (WIRESPAN_LAB_KEEP=1 keeps it)"
fi
