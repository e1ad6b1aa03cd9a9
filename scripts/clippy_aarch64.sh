#!/usr/bin/env bash
# `cargo clippy --all-targets -D warnings` for aarch64 Linux from an x86-64 host: the NEON
# paths (src/model/linear/simd/arm.rs, quant/simd/arm.rs) and every cfg(target_arch) split
# are linted as an ARM build sees them. Needs the rust-std of aarch64-unknown-linux-gnu
# (rustup) and a C/C++ cross compiler for the dependencies' build scripts (Debian's
# gcc-aarch64-linux-gnu and g++-aarch64-linux-gnu); both are installed when missing. Where
# they cannot be installed, it says SKIPPED and why, and exits 0: the lint itself failing
# exits non-zero. About 7 minutes fresh on 2 cores, seconds after.
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu

skip() {
  echo "SKIPPED: clippy for $target: $1" >&2
  exit 0
}

if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  rustup target add "$target" >/dev/null 2>&1 || skip "rustup target add $target failed"
fi
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || skip "no aarch64-linux-gnu-gcc and no root to install it"
    sudo="sudo -n"
  fi
  ($sudo apt-get install -y -q gcc-aarch64-linux-gnu g++-aarch64-linux-gnu >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null 2>&1 &&
      $sudo apt-get install -y -q gcc-aarch64-linux-gnu g++-aarch64-linux-gnu >/dev/null 2>&1; }) ||
    skip "apt-get could not install gcc-aarch64-linux-gnu"
fi
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy >/dev/null 2>&1 ||
  skip "no clippy component, and rustup could not add it"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
cargo clippy --target "$target" --all-targets -- -D warnings
echo "clippy clean for $target" >&2
