#!/usr/bin/env bash
# One line naming what the suite ran, from the `KIND VALUE KERNEL-RELEASE` lines tests
# append to FILE (dataplane/tests/support/ran.rs): which WireGuard backends and which
# fast-path attach modes, overall and per kernel (this host's, the VM's).
#
#   scripts/ran-summary.sh FILE
set -euo pipefail
file=${1:?usage: $0 FILE}
if [ ! -s "$file" ]; then
  echo "suite ran: nothing recorded (no kernel test ran)"
  exit 0
fi
sort -u "$file" | awk -v host="$(uname -r)" '
  function add(list, v) { return list == "" ? v : list "+" v }
  NF == 3 {
    all[$1] = index("+" all[$1] "+", "+" $2 "+") ? all[$1] : add(all[$1], $2)
    per[$3, $1] = add(per[$3, $1], $2)
    if (!($3 in seen)) { seen[$3] = 1; order[n++] = $3 }
  }
  END {
    line = "suite ran: WireGuard " (all["wireguard"] == "" ? "none" : all["wireguard"]) \
           ", fast-path attach " (all["attach"] == "" ? "none" : all["attach"])
    # The host first, then the VM.
    for (j = 0; j < 2 * n; j++) {
      r = order[j % n]
      if ((j < n) != (r == host)) continue
      where = (r == host) ? "host" : "vm"
      line = line "; " where " " r ": " \
             (per[r, "wireguard"] == "" ? "-" : per[r, "wireguard"]) ", " \
             (per[r, "attach"] == "" ? "-" : per[r, "attach"])
    }
    print line
  }'
