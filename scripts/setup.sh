#!/usr/bin/env bash
# Installs what wirespan needs on a fresh Debian machine of this kind, idempotently:
# system packages only when a command is missing, and the Rust components the checks use.
set -euo pipefail

need=()
have() { command -v "$1" >/dev/null 2>&1; }
have clang        || need+=(clang)
# libfuzzer-sys builds libFuzzer (C++) when the suite checks the fuzz targets.
have c++          || need+=(g++)
have llvm-strip   || need+=(llvm)
[ -f /usr/include/bpf/bpf_helpers.h ] || need+=(libbpf-dev)
have nft          || need+=(nftables)
have wg           || need+=(wireguard-tools)
have wireguard-go || need+=(wireguard-go)
have ip           || need+=(iproute2)
have ping         || need+=(iputils-ping)
# The NAT lab tests read the routers' conntrack tables (tests/lab_nat.rs), with
# conntrack(8) where the kernel has no /proc/net/nf_conntrack.
have conntrack    || need+=(conntrack)
have nsenter      || need+=(util-linux)
have unshare      || need+=(util-linux)
have setsid       || need+=(util-linux)
have findmnt      || need+=(util-linux)
have mount        || need+=(mount)
have curl         || need+=(curl)
have ss           || need+=(iproute2)
have sysctl       || need+=(procps)
have openssl      || need+=(openssl)
# `wirespan bench throughput` (its --quick run is in the suite).
have iperf3       || need+=(iperf3)
# The operations tests: unit files (systemd-analyze verify, which also resolves their
# man: links), capability sets (setpriv) and completions (bash).
have systemd-analyze || need+=(systemd)
have man          || need+=(man-db)
have setpriv      || need+=(util-linux)
have bash         || need+=(bash)
# The discovery server's pages are checked in headless Chromium
# (tests/discovery_pages_browser.rs).
[ -x /usr/bin/chromium ] || need+=(chromium)

# The VM tier (scripts/vm.sh, tests run inside Debian 12's 6.1 kernel): QEMU, the
# kernel (the generic flavour: the cloud one has no 9p) and busybox for virtme-ng's
# initramfs. Debian stable's versions, checked below: QEMU 7.2, kernel 6.1.
have qemu-system-x86_64 || need+=(qemu-system-x86)
ls /boot/vmlinuz-6.1.*-amd64 >/dev/null 2>&1 || need+=(linux-image-amd64)
have busybox || need+=(busybox-static)

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

case "$(qemu-system-x86_64 --version | head -n1)" in
  *"version 7.2"*) ;;
  *) echo "setup: the VM tier was checked with QEMU 7.2 (Debian 12); found: $(qemu-system-x86_64 --version | head -n1)" >&2 ;;
esac

# virtme-ng boots a kernel with this machine's filesystem as the guest's root.
VIRTME_NG_VERSION=1.42
if [ "$(vng --version 2>/dev/null)" != "virtme-ng $VIRTME_NG_VERSION" ]; then
  echo "setup: installing virtme-ng $VIRTME_NG_VERSION (PyPI)" >&2
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet "virtme-ng==$VIRTME_NG_VERSION"
  hash -r
fi

# Kubernetes manifests are checked against the Kubernetes schemas
# (tests/deploy_manifests.rs runs `python3 -m kubernetes_validate`).
if ! python3 -c 'import kubernetes_validate' >/dev/null 2>&1; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || { echo "setup: need pip to install kubernetes-validate; run as root" >&2; exit 1; }
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends python3-pip
  fi
  echo "setup: installing kubernetes-validate (PyPI)" >&2
  # Debian's own python3 refuses system-wide pip installs without this flag; a pyenv
  # or venv python ignores it.
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet kubernetes-validate
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
