#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser (fuzz/fuzz_targets/*.rs): builds the fuzz crate, then
# runs each target for SECONDS (default 60) from its checked-in corpus (fuzz/corpus/<target>/),
# with a memory limit and a per-input timeout. Fails (exit 1) when any target finds a crash, a
# panic, an out-of-memory or a timeout; the input that did it is kept in
# fuzz/artifacts/<target>/ (print it with `xxd`, reproduce with
# `fuzz/target/$TRIPLE/release/<target> fuzz/artifacts/<target>/<file>`).
#
# Usage: scripts/fuzz.sh [SECONDS]            every target
#        FUZZ_TARGETS="trace_jsonl config_parse" scripts/fuzz.sh 30
# Needs: Rust (stable is enough) and a C++ compiler (libfuzzer-sys builds libFuzzer).
#
# Why no cargo-fuzz and no nightly: `cargo fuzz` drives the same build (cargo build --release
# with these RUSTFLAGS and an explicit --target), and by default adds -Zsanitizer=address, which
# needs nightly; with `--sanitizer none` it passes only stable flags, which is what this script
# does itself, so no extra tool is installed. The flags give libFuzzer its coverage (SanitizerCoverage
# through LLVM: 8-bit edge counters, the PC table and comparison tracing, as cargo-fuzz sets
# them); `--cfg fuzzing` is what libfuzzer-sys and cargo-fuzz set; overflow and debug
# assertions are on so arithmetic overflow is a finding. No address sanitizer: the fuzzed code
# is safe Rust (the crates deny unsafe code outside the CUDA backend and the C ABI, which no
# target reaches), so memory errors cannot occur there; panics, aborts, stack overflows (a
# deadly signal to libFuzzer), timeouts and memory over the limit are all caught.
# The explicit --target keeps these flags off build scripts and proc macros.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_TARGET="${1:-60}"
RSS_LIMIT_MB="${FUZZ_RSS_LIMIT_MB:-2048}"
INPUT_TIMEOUT_S="${FUZZ_INPUT_TIMEOUT_S:-10}"
case "$SECONDS_PER_TARGET" in
    '' | *[!0-9]*)
        echo "usage: scripts/fuzz.sh [SECONDS] (a whole number of seconds per target)" >&2
        exit 2
        ;;
esac

TRIPLE="$(rustc -vV | sed -n 's/^host: //p')"
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
# Separate from the workspace's target/ (different flags would rebuild everything there).
# Not --locked: fuzz/Cargo.lock is the workspace's lock plus libfuzzer-sys, and a dependency
# added to the core crates is resolved here on the next build.
export CARGO_TARGET_DIR="$PWD/fuzz/target"
cargo build --release --manifest-path fuzz/Cargo.toml --target "$TRIPLE" --bins

if [ -n "${FUZZ_TARGETS:-}" ]; then
    read -r -a targets <<< "$FUZZ_TARGETS"
else
    targets=()
    for f in fuzz/fuzz_targets/*.rs; do
        targets+=("$(basename "$f" .rs)")
    done
fi

# One target's run; its status lands in fuzz/artifacts/<target>/status.
fuzz_one() {
    local t="$1" bin="fuzz/target/$TRIPLE/release/$1" seeds="fuzz/corpus/$1" work
    mkdir -p "$seeds" "fuzz/artifacts/$t"
    # New inputs go to a scratch corpus so the checked-in one stays small.
    work="$(mktemp -d)"
    if "$bin" "$work" "$seeds" \
        -max_total_time="$SECONDS_PER_TARGET" \
        -rss_limit_mb="$RSS_LIMIT_MB" \
        -timeout="$INPUT_TIMEOUT_S" \
        -artifact_prefix="fuzz/artifacts/$t/" \
        -print_final_stats=1 > "fuzz/artifacts/$t/log.txt" 2>&1; then
        echo ok > "fuzz/artifacts/$t/status"
    else
        echo failed > "fuzz/artifacts/$t/status"
    fi
    rm -rf "$work"
}

# FUZZ_JOBS targets at a time (default: one per core); each fuzzes on one core.
JOBS="${FUZZ_JOBS:-$(nproc)}"
echo "== ${#targets[@]} targets, ${SECONDS_PER_TARGET} s each, $JOBS at a time"
for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do
        wait -n || true
    done
    fuzz_one "$t" &
done
wait

failed=()
for t in "${targets[@]}"; do
    if [ "$(cat "fuzz/artifacts/$t/status" 2>/dev/null)" = ok ]; then
        echo "$t: $(grep -E '^stat::number_of_executed_units' "fuzz/artifacts/$t/log.txt" | tr -s ' ')"
    else
        echo "FAILED: $t (see fuzz/artifacts/$t/log.txt)"
        grep -E 'ERROR|panicked|SUMMARY|Test unit written' "fuzz/artifacts/$t/log.txt" | head -n 20 || true
        failed+=("$t")
    fi
done

if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzzing found problems in: ${failed[*]}"
    exit 1
fi
echo "fuzzing: ${#targets[@]} targets, ${SECONDS_PER_TARGET} s each, nothing found"
