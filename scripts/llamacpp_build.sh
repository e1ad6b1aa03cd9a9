#!/usr/bin/env bash
# Build llama.cpp from source (pinned), for scripts/bench_llamacpp.py.
#
#   scripts/llamacpp_build.sh            (writes target/llama.cpp/)
#
# The sources come from PyPI: the llama-cpp-python sdist vendors llama.cpp (vendor/llama.cpp,
# with convert_hf_to_gguf.py and gguf-py). It is fetched with `pip download --no-binary`
# (sha256 checked), extracted to target/llama.cpp/src/ and built with cmake in Release with
# -DGGML_NATIVE=ON (all the host's instruction sets, as a user building it would), only the
# tools the benchmarks need: llama-bench, llama-batched-bench, llama-quantize, llama-perplexity.
# If there is no cmake on PATH, one is pip-installed into target/venv-llamacpp.
# Idempotent: when target/llama.cpp/build/.complete exists and every tool is built, it only
# says so.
# Time on the 2-core Zen 3 host (-j2, other builds running): see scripts/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
top=target/llama.cpp
src="$top/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
build="$top/build"
targets=(llama-bench llama-batched-bench llama-quantize llama-perplexity)

built=yes
for t in "${targets[@]}"; do [ -x "$build/bin/$t" ] || built=no; done
if [ -f "$build/.complete" ] && [ "$built" = yes ]; then
    echo "llama.cpp (llama-cpp-python $VERSION) already built in $build/bin"
    exit 0
fi
mkdir -p "$top/dl"
sdist="$top/dl/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    # --no-binary for this package only: its build dependencies (cmake, scikit-build-core)
    # come as wheels, so preparing the sdist's metadata takes seconds, not a cmake build
    "${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$top/dl"
fi
echo "$SHA256  $sdist" | sha256sum -c --quiet
if [ ! -f "$src/CMakeLists.txt" ]; then
    rm -rf "$top/src" && mkdir -p "$top/src"
    tar xzf "$sdist" -C "$top/src" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi

# On a CPU with AMX (Intel since Sapphire Rapids) the pinned sources crash at their first
# AMX product (SIGSEGV at `ldtilecfg` in ggml_backend_amx_mul_mat; ggml-org/llama.cpp#20824):
# the tile configuration is a local whose stores the compiler may drop, and `ldtilecfg` then
# faults on what is left. The fix of ggml-org/llama.cpp#26954, applied here: keep it in
# static storage. Nothing else changes; idempotent.
mmq="$src/ggml/src/ggml-cpu/amx/mmq.cpp"
sed -i 's/^    alignas(64) tile_config_t tc = {};$/    alignas(64) static thread_local tile_config_t tc = {};/' "$mmq"
grep -q 'static thread_local tile_config_t tc' "$mmq"

cmake_bin=$(command -v cmake || true)
if [ -z "$cmake_bin" ]; then
    venv=target/venv-llamacpp
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check cmake==4.1.3
    cmake_bin="$PWD/$venv/bin/cmake"
fi

start=$(date +%s)
"$cmake_bin" -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
"$cmake_bin" --build "$build" -j2 --target "${targets[@]}"
secs=$(( $(date +%s) - start ))
for t in "${targets[@]}"; do test -x "$build/bin/$t"; done
echo "llama-cpp-python $VERSION, built in ${secs}s on $(nproc) cores" > "$build/.complete"
echo "built ${targets[*]} in $build/bin (${secs}s)"
