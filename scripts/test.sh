#!/usr/bin/env bash
# Every test of the project: formatting and lints, the Rust tests of all crates (core, C ABI,
# stress tool), and the Python package's tests against the built library.
# Needs: Rust, cc/c++, python3 with pytest and prometheus_client, Debian's prometheus package.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The C ABI and Python tests load the release library.
cargo build --release -p stepalloc-cabi
cargo test --workspace
python3 -m pytest python_shim/tests -q
