#!/usr/bin/env bash
# The main job. Until the multi-node lab lands this runs the most complete real
# service: the discovery server on loopback, with metrics and its inspect page.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --locked
exec ./target/release/wirespan discovery \
  --listen 127.0.0.1:3000 \
  --metrics-listen 127.0.0.1:2122 \
  "$@"
