#!/usr/bin/env bash
# Installs what wirespan needs on a fresh Debian machine of this kind, idempotently:
# system packages only when a command is missing, and the Rust components the checks use.
set -euo pipefail

need=()
have() { command -v "$1" >/dev/null 2>&1; }
have clang        || need+=(clang)
have llvm-strip   || need+=(llvm)
[ -f /usr/include/bpf/bpf_helpers.h ] || need+=(libbpf-dev)
have nft          || need+=(nftables)
have wg           || need+=(wireguard-tools)
have wireguard-go || need+=(wireguard-go)
have ip           || need+=(iproute2)
have ping         || need+=(iputils-ping)
have nsenter      || need+=(util-linux)
have unshare      || need+=(util-linux)
have setsid       || need+=(util-linux)
have findmnt      || need+=(util-linux)
have mount        || need+=(mount)
have curl         || need+=(curl)
have ss           || need+=(iproute2)
have sysctl       || need+=(procps)
have openssl      || need+=(openssl)

if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing system packages (${need[*]}); run as root to install them" >&2
    exit 1
  fi
  echo "setup: installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # --no-install-recommends: wireguard-tools would otherwise pull in a kernel.
  apt-get install -y -q --no-install-recommends "${need[@]}"
fi

if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  rustup component add rustfmt clippy
fi

# The suite runs under nextest (one process per test, so namespace state cannot leak
# between tests); there is no fallback to plain `cargo test`.
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "setup: installing cargo-nextest from crates.io" >&2
  cargo install cargo-nextest --locked
fi
