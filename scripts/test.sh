#!/usr/bin/env bash
# The full test suite: formatting, lints, and every test tier (unit, controller,
# kernel tests in throwaway network namespaces, end-to-end). Kernel tiers need root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

cargo fmt --all -- --check
(cd fuzz && cargo fmt --all -- --check)
cargo clippy --workspace --all-targets --locked -- -D warnings
# The fuzz targets are their own workspace (fuzzing needs nightly cargo-fuzz), so the
# line above never compiles them: check them on stable against the crates they drive.
# --locked also catches fuzz/Cargo.lock falling behind a dependency change.
(cd fuzz && cargo check --bins --locked --target-dir ../target)

# Tests append what they ran (WireGuard backend, fast-path attach mode) here; the
# last line of the run names it all (scripts/ran-summary.sh).
export WIRESPAN_TEST_RECORD="$PWD/target/suite-ran.txt"
rm -f "$WIRESPAN_TEST_RECORD"

# Doc tests first, so the run ends on the summary of the whole suite.
cargo test --workspace --locked --doc
# nextest runs each test in its own process: kernel tests that enter namespaces
# cannot leak that state into their neighbours. setup.sh installed it.
status=0
cargo nextest run --workspace --locked --no-fail-fast || status=$?
# The VM tier: the kernel-dependent tests and the e2e labs again on Debian's 6.1 kernel (kernel
# WireGuard, clsact), with the binaries just built. WIRESPAN_VM_TIER=0 leaves it out.
if [ "${WIRESPAN_VM_TIER:-1}" != 0 ]; then
  bash scripts/vm-tier.sh || status=$?
fi
bash scripts/ran-summary.sh "$WIRESPAN_TEST_RECORD"
exit "$status"
