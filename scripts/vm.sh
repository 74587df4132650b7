#!/usr/bin/env bash
# Runs a command as root in a fresh QEMU guest whose root filesystem is this machine's
# (virtme-ng over 9p, read-only but for the repository's target/ and the guest's own
# /run and /tmp), so kernel-dependent code can be tried on another kernel: by default
# Debian's 6.1 (`linux-image-amd64`: WireGuard module, clsact but no tcx).
#
#   scripts/vm.sh [--kernel debian|PATH] [--cpus N] [--memory SIZE] [--cache FILE]... -- CMD...
#
# The command runs in the repository root; its exit status, stdout and stderr are the
# script's. One line on stderr, printed by the guest, says which kernel and which
# accelerator ran. KVM is used where a guest boots with it (a short probe, its result
# kept in target/vm/), TCG otherwise; WIRESPAN_VM_ACCEL=kvm|tcg skips the probe.
# --cache FILE (repeatable) keeps FILE open in the guest for the whole run. The guest's
# 9p mounts keep no cache: a file nobody has open is forgotten, and every exec reads
# the binary and its libraries from the host again (under TCG on a busy machine a
# 100 MB debug `wirespan` took 15 s to start, /bin/true 1.5 s). Held open, its pages
# stay in the guest's memory: under a second and 0.3 s.
# Environment variables named WIRESPAN_*, RUST_*, NEXTEST_* and CARGO_* are passed in.
# scripts/setup.sh installs qemu, the kernel and virtme-ng.
set -euo pipefail

usage() {
  echo "usage: $0 [--kernel debian|PATH] [--cpus N] [--memory SIZE] [--cache FILE]... -- CMD..." >&2
  exit 2
}

kernel=debian cpus=2 memory=4G
cache=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cache) cache+=("$(realpath -e "${2:?}")") || exit 2; shift 2 ;;
    --kernel) kernel=${2:?}; shift 2 ;;
    --cpus) cpus=${2:?}; shift 2 ;;
    --memory) memory=${2:?}; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[ $# -gt 0 ] || usage
[ "$(id -u)" -eq 0 ] || { echo "vm: must run as root (the guest runs CMD as the caller)" >&2; exit 2; }
command -v vng >/dev/null || { echo "vm: vng (virtme-ng) missing: run scripts/setup.sh" >&2; exit 2; }

repo=$(cd "$(dirname "$0")/.." && pwd)

if [ "$kernel" = debian ]; then
  # The newest Debian 6.1 kernel image installed (linux-image-amd64 pulls it in).
  kernel=$(ls -1v /boot/vmlinuz-6.1.*-amd64 2>/dev/null | tail -n1 || true)
  [ -n "$kernel" ] || { echo "vm: no /boot/vmlinuz-6.1.*-amd64: run scripts/setup.sh" >&2; exit 2; }
fi
[ -f "$kernel" ] || { echo "vm: kernel image $kernel not found" >&2; exit 2; }

mkdir -p "$repo/target/vm"

# vng's base options; the guest's /run is its own tmpfs (the host's /run over 9p breaks
# unix sockets), target/ is the one writable host directory.
base=(vng --run "$kernel" --force-9p --cpus "$cpus" --memory "$memory"
      --rwdir "$repo/target" --cwd "$repo")

# KVM where a guest boots with it. Nested KVM here either fails at once (an MSR qemu
# cannot set) or hangs in early boot, so the probe is a bounded boot of `true`.
accel=${WIRESPAN_VM_ACCEL:-auto}
if [ "$accel" = auto ]; then
  probe="$repo/target/vm/accel-$(uname -r)-$(basename "$kernel")"
  if [ -f "$probe" ]; then
    accel=$(cat "$probe")
  elif [ -r /dev/kvm ] && [ -w /dev/kvm ] \
      && timeout 30 "${base[@]}" --exec true </dev/null >/dev/null 2>&1; then
    accel=kvm
  else
    accel=tcg
  fi
  echo "$accel" >"$probe"
fi
case "$accel" in
  kvm) ;;
  tcg) base+=(--disable-kvm) ;;
  *) echo "vm: WIRESPAN_VM_ACCEL must be kvm, tcg or auto" >&2; exit 2 ;;
esac

# The guest's script: the passed environment, the line naming kernel and
# accelerator (from inside the guest, so it proves which kernel ran), then CMD.
script=""
for name in $(compgen -e); do
  case "$name" in
    WIRESPAN_*|RUST_*|NEXTEST_*|CARGO_*|PATH|HOME|TERM)
      script+="export $name=$(printf '%q' "${!name}"); " ;;
  esac
done
# A booted Debian creates /dev/net/tun (wireguard-go needs it) from the module's static
# node; virtme-ng's init does not.
script+="modprobe -q tun 2>/dev/null || true; "
# The cached files: one background process holds them all open (its own process, so
# CMD inherits no extra descriptors; the guest's power-off ends it).
if [ ${#cache[@]} -gt 0 ]; then
  script+="( "
  for f in "${cache[@]}"; do
    script+="exec {fd}<$(printf '%q' "$f"); "
  done
  script+="exec sleep infinity ) </dev/null >/dev/null 2>&1 & "
fi
script+="echo \"vm: kernel \$(uname -r) ($(printf '%q' "$kernel")), accelerator $accel, $cpus cpus, $memory\" >&2; "
script+="cd $(printf '%q' "$repo") && exec $(printf '%q ' "$@")"

# The script goes to the guest as a file in target/vm/: virtme-ng would pass it on the
# kernel command line, which the kernel cuts at 2048 bytes (the guest then hangs).
guest_script=$(mktemp "$repo/target/vm/guest-XXXXXX.sh")
trap 'rm -f "$guest_script"' EXIT
printf '%s\n' "$script" >"$guest_script"

# qemu reopens its stdout and stderr by path: were they one file (2>&1 >log), its
# writes would overwrite ours. Pipes keep the order and nothing is lost.
set +e
"${base[@]}" --exec "bash $(printf '%q' "$guest_script")" </dev/null 2> >(cat >&2) | cat
status=${PIPESTATUS[0]}
wait
exit "$status"
