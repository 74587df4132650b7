#!/usr/bin/env bash
# Runs every cargo-fuzz target of fuzz/ for a bounded time, one after the other.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default 60 s, all targets)
#
# Needs the nightly toolchain (libFuzzer instrumentation); installs cargo-fuzz if it is
# missing. Each target starts from its committed seed corpus fuzz/corpus/<target>/,
# copied into a temporary working corpus, so what the run discovers never lands in
# the committed directories. Crash inputs are written to fuzz/artifacts/<target>/
# (ignored by git); reproduce one with
#   cargo +nightly fuzz run -a <target> fuzz/artifacts/<target>/<file>
# then commit it as fuzz/regressions/<target>/<name> (tests/fuzz_replay.rs replays
# it on stable) and add a unit test next to the code it broke.
#
# Prints per target the executions (libFuzzer's stat::number_of_executed_units) and
# the crashes found; exits non-zero if any target crashed or failed to run.
set -euo pipefail

secs="${1:-60}"
shift || true
case "$secs" in
'' | *[!0-9]*)
	echo "usage: $0 [SECONDS_PER_TARGET] [TARGET...]" >&2
	exit 2
	;;
esac

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root/fuzz"

if ! cargo +nightly --version >/dev/null 2>&1; then
	echo "fuzz.sh: the nightly toolchain is needed (cargo +nightly --version failed)." >&2
	echo "Install it with: rustup toolchain install nightly" >&2
	exit 2
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
	echo "fuzz.sh: installing cargo-fuzz" >&2
	cargo install cargo-fuzz --locked
fi

# Debug assertions on: overflow checks catch arithmetic bugs the release build hides.
flags=(-a)
if [ "$#" -gt 0 ]; then
	targets=("$@")
else
	mapfile -t targets < <(cargo +nightly fuzz list)
fi

echo "building ${#targets[@]} fuzz targets" >&2
cargo +nightly fuzz build "${flags[@]}" >&2

work="$(mktemp -d -t wirespan-fuzz.XXXXXX)"
trap 'rm -rf "$work"' EXIT

failed=0
results=()
for t in "${targets[@]}"; do
	corpus="$work/corpus/$t"
	mkdir -p "$corpus"
	if [ -d "corpus/$t" ]; then
		cp -r "corpus/$t/." "$corpus/"
	fi
	log="$work/$t.log"
	echo "fuzzing $t for ${secs}s" >&2
	rc=0
	cargo +nightly fuzz run "${flags[@]}" "$t" "$corpus" -- \
		-max_total_time="$secs" -print_final_stats=1 -timeout=30 >"$log" 2>&1 || rc=$?
	execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)"
	crashes="$(grep -c -E '^(artifact_prefix=.*; )?Test unit written to ' "$log" || true)"
	if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then
		# A failure without an artifact (build error, sanitizer abort before writing).
		crashes=1
	fi
	if [ "$crashes" -ne 0 ]; then
		failed=1
		echo "---- $t failed (exit $rc); end of its log:" >&2
		tail -n 40 "$log" >&2
	fi
	results+=("$(printf '%-20s %14s %8s' "$t" "${execs:-?}" "$crashes")")
done

printf '%-20s %14s %8s\n' target executions crashes
printf '%s\n' "${results[@]}"
exit "$failed"
