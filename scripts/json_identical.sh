#!/usr/bin/env bash
# Are the stress tool's `--json` outputs the same, byte for byte, as another build's? For
# changes that must not change behaviour (moving code, renaming, splitting files): the three
# real-model traces under `replay` and `advise`, both agent presets (one on two devices, with
# every step) and one replay with `--explain --per-step`.
#
#   scripts/json_identical.sh save [DIR]   this tree's outputs become the reference (DIR,
#                                          default target/json-ref)
#   scripts/json_identical.sh check [DIR]  this tree's outputs against the reference in DIR
#   scripts/json_identical.sh rev REV      builds REV (a commit, branch or tag) in a temporary
#                                          git worktree with its own target dir (the first time:
#                                          every dependency, minutes), saves its outputs, then
#                                          checks this tree's against them
#
# The wall-clock figures (`parse_s`, `wall_s`, `ops_per_s`, `search_s`) differ between two runs
# of the same build; their values are replaced by "<wall>" (the keys stay) before comparing.
# Everything else is the simulated device's and is deterministic. STRESS_BIN names a prebuilt
# binary to use instead of building this tree's (debug) one. Exit status: 0 identical, 1 not.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() {
    sed -n '7,13p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# Every output, as "name|arguments" (run from the repository root: the trace paths are part of
# the output).
CASES=(
    "replay_llama_sft|replay stress/tests/data/model_llama_sft.jsonl"
    "replay_vlm_agent|replay stress/tests/data/model_vlm_agent.jsonl"
    "replay_vlm_agent_trained_vision|replay stress/tests/data/model_vlm_agent_trained_vision.jsonl"
    "replay_vlm_agent_explain_per_step|--explain --per-step replay stress/tests/data/model_vlm_agent.jsonl"
    "agent_vlm_7b|agent --preset vlm-7b --iterations 2"
    "agent_vlm_7b_two_devices_per_step|--per-step agent --preset vlm-7b --iterations 1 --devices 2"
    "agent_llm_7b_sft|agent --preset llm-7b-sft --iterations 4"
    "advise_llama_sft|advise stress/tests/data/model_llama_sft.jsonl"
    "advise_vlm_agent|advise stress/tests/data/model_vlm_agent.jsonl"
    "advise_vlm_agent_trained_vision|advise stress/tests/data/model_vlm_agent_trained_vision.jsonl"
)

# write_outputs BIN DIR: every case's masked output into DIR/<name>.json.
write_outputs() {
    local bin=$1 dir=$2 case name args
    rm -rf "$dir"
    mkdir -p "$dir"
    for case in "${CASES[@]}"; do
        name=${case%%|*}
        args=${case#*|}
        # shellcheck disable=SC2086 # the arguments are words
        if ! "$bin" --json $args > "$dir/$name.raw" 2> "$dir/$name.err"; then
            echo "json_identical: $bin --json $args failed:" >&2
            tail -n 20 "$dir/$name.err" >&2
            exit 1
        fi
        sed -E 's/^( *"(parse_s|wall_s|ops_per_s|search_s)": )[^,]*(,?)$/\1"<wall>"\3/' \
            "$dir/$name.raw" > "$dir/$name.json"
        rm -f "$dir/$name.raw" "$dir/$name.err"
    done
}

this_build() {
    if [ -n "${STRESS_BIN:-}" ]; then
        echo "$STRESS_BIN"
        return
    fi
    cargo build -q -p stepalloc-stress >&2
    echo "$ROOT/target/debug/stepalloc-stress"
}

# compare REF NEW: byte for byte, every case.
compare() {
    local ref=$1 new=$2 case name bad=0
    for case in "${CASES[@]}"; do
        name=${case%%|*}
        if [ ! -f "$ref/$name.json" ]; then
            echo "json_identical: no reference $ref/$name.json (run: $0 save)" >&2
            bad=1
        elif ! cmp -s "$ref/$name.json" "$new/$name.json"; then
            echo "json_identical: $name differs:" >&2
            diff -u "$ref/$name.json" "$new/$name.json" | head -n 40 >&2 || true
            bad=1
        fi
    done
    if [ "$bad" = 0 ]; then
        echo "json_identical: ${#CASES[@]} outputs identical to $ref"
    fi
    return "$bad"
}

[ $# -ge 1 ] || usage
case "$1" in
    save)
        dir=${2:-target/json-ref}
        write_outputs "$(this_build)" "$dir"
        echo "json_identical: ${#CASES[@]} reference outputs in $dir ($(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ', with uncommitted changes'))"
        ;;
    check)
        dir=${2:-target/json-ref}
        write_outputs "$(this_build)" target/json-new
        compare "$dir" target/json-new
        ;;
    rev)
        [ $# -eq 2 ] || usage
        sha=$(git rev-parse --verify "$2^{commit}")
        tree=$(mktemp -d)
        trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || true; rm -rf "$tree"' EXIT
        git worktree add --detach -q "$tree" "$sha"
        # Its own target dir, kept between calls: a later `rev` rebuilds only the project's crates.
        (cd "$tree" && cargo build -q -p stepalloc-stress --target-dir "$ROOT/target/json-rev-build")
        write_outputs "$ROOT/target/json-rev-build/debug/stepalloc-stress" "target/json-rev-${sha:0:12}"
        write_outputs "$(this_build)" target/json-new
        compare "target/json-rev-${sha:0:12}" target/json-new
        ;;
    *) usage ;;
esac
