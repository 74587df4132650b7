#!/usr/bin/env bash
# The full test suite: formatting, lints, and every test tier (unit, controller,
# kernel tests in throwaway network namespaces, end-to-end). Kernel tiers need root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The fuzz targets are their own workspace (fuzzing needs nightly cargo-fuzz), so the
# line above never compiles them: check them on stable against the crates they drive.
# --locked also catches fuzz/Cargo.lock falling behind a dependency change.
(cd fuzz && cargo check --bins --locked --target-dir ../target)

# Doc tests first, so the run ends on the summary of the whole suite.
cargo test --workspace --locked --doc
# nextest runs each test in its own process: kernel tests that enter namespaces
# cannot leak that state into their neighbours. setup.sh installed it.
cargo nextest run --workspace --locked --no-fail-fast
