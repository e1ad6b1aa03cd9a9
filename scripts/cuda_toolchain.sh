#!/usr/bin/env bash
# A CUDA toolkit from PyPI, enough to build tiny-decoder with `--features cuda` on a machine
# without a GPU or a system CUDA install:
#
#   eval "$(scripts/cuda_toolchain.sh)"
#   cargo build --features cuda
#
# Creates a venv (default $CARGO_TARGET_DIR/cuda-venv, else target/cuda-venv; override with
# TINY_DECODER_CUDA_VENV), installs scripts/requirements-cuda.txt into it (~1.2 GB, mostly
# cuBLAS), and prints on stdout the `export` lines the build needs; progress goes to stderr.
# Run again, it only re-checks the install.
#
# The wheels lay out a toolkit tree under site-packages/nvidia/cu13 (bin/nvcc, include/,
# lib/) but leave two gaps that this script fills inside that tree:
# - the linker wants unversioned names (-lcublas finds libcublas.so, the wheels ship only
#   libcublas.so.13): symlinks in lib/;
# - libcuda.so comes with the NVIDIA driver, not with the toolkit: lib/stubs/libcuda.so is
#   built here from cuda.h's names, every function returning CUDA_ERROR_STUB_LIBRARY (34),
#   as the toolkit's own stub does. It only satisfies the linker; on a machine with a driver
#   the driver's libcuda.so.1 is the one loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TINY_DECODER_CUDA_VENV:-${CARGO_TARGET_DIR:-target}/cuda-venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "+ $python -m venv $venv" >&2
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile \
    -r scripts/requirements-cuda.txt >&2

root="$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
root="$(cd "$root" && pwd)"
[ -x "$root/bin/nvcc" ] || { echo "no nvcc under $root/bin" >&2; exit 1; }

# Unversioned names for the libraries cudarc and candle-kernels link (-l<name>).
for lib in cudart cublas cublasLt curand nvrtc; do
    versioned="$(cd "$root/lib" && ls "lib$lib.so."* | head -n 1)"
    ln -sfn "$versioned" "$root/lib/lib$lib.so"
done

# The driver API stub, soname libcuda.so.1 like the driver's own library.
stub="$root/lib/stubs/libcuda.so"
if [ ! -f "$stub" ] || [ "$root/include/cuda.h" -nt "$stub" ]; then
    mkdir -p "$root/lib/stubs"
    grep -o '\bcu[A-Z][A-Za-z0-9_]*' "$root/include/cuda.h" | sort -u |
        sed 's/.*/int &(void) { return 34; }/' >"$root/lib/stubs/libcuda_stub.c"
    "${CC:-cc}" -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub" "$root/lib/stubs/libcuda_stub.c"
    ln -sfn libcuda.so "$root/lib/stubs/libcuda.so.1"
fi

# At run time the stub stands in for the driver only where there is no driver, so that
# test binaries start (and find no GPU) instead of failing to load.
ld_path="$root/lib"
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
    ld_path="$ld_path:$root/lib/stubs"
fi

cat <<VARS
export PATH="$root/bin:\$PATH"
export CUDA_ROOT="$root" CUDA_PATH="$root" CUDA_HOME="$root"
export LD_LIBRARY_PATH="$ld_path\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
VARS
