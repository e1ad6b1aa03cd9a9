#!/usr/bin/env bash
# The CUDA checks on a machine with an NVIDIA GPU, from binaries built elsewhere (a GPU host
# may have no Rust toolchain): tests/cuda.rs, and `bench --device cuda` beside the CPU on the
# bench configs (random weights: no checkpoint to copy), with transformers on the same GPU
# and config for reference when torch is there.
#
#   # on the build machine (no GPU needed):
#   eval "$(scripts/cuda_toolchain.sh)"; export CUDA_COMPUTE_CAP=90   # 90: H100/H200
#   CARGO_TARGET_DIR=target-cuda cargo build --release --features cuda
#   CARGO_TARGET_DIR=target-cuda cargo test --release --features cuda --no-run --test cuda
#   mkdir -p target-gpu && cp target-cuda/release/tiny-decoder target-gpu/ &&
#     cp "$(ls -t target-cuda/release/deps/cuda-* | grep -v '\.d$' | head -1)" target-gpu/cuda-tests
#   # on the GPU host, from the repository root, with target-gpu/ beside it:
#   scripts/cuda_check.sh target-gpu
#
# cudarc loads the driver and CUDA's libraries at run time: libcuda.so.1 from the driver, and
# cuBLAS/cuRAND/NVRTC of CUDA 13 from wherever they are installed (a system toolkit, or
# PyTorch's nvidia-* wheels, found below).
set -uo pipefail
cd "$(dirname "$0")/.."
bins="${1:-target-gpu}"
out="${OUT:-target/cuda-check}"
mkdir -p "$out"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
libs="$(find / -xdev \( -name 'libcublas.so.13*' -o -name 'libcublasLt.so.13*' \) 2>/dev/null |
    xargs -r -n1 dirname | sort -u | tr '\n' ':')"
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:-}"
echo "CUDA libraries from: ${libs:-(system paths)}"

echo "== tests/cuda.rs"
"$bins/cuda-tests" --test-threads 1 2>&1 | tee "$out/cuda-tests.log"

bench() { "$bins/tiny-decoder" bench "$@" --json 2>&1 | tail -n 1; }
echo "== bench: device config dtype prompt+new -> json"
for config in configs/bench-smollm135m.json configs/bench-smollm2-1.7b.json; do
    for dtype in f32 bf16; do
        for device in cuda cpu; do
            # The CPU rows only for the 135M shape: the 1.7B one takes minutes there.
            if [ "$device" = cpu ] && [ "$config" != configs/bench-smollm135m.json ]; then continue; fi
            for case in "128 128" "1024 32"; do
                set -- $case
                echo "$device $config $dtype $1+$2 $(RAYON_NUM_THREADS=16 bench --config "$config" \
                    --dtype "$dtype" --device "$device" --prompt-tokens "$1" --new-tokens "$2")"
            done
        done
    done
done | tee "$out/bench.log"
echo "== generate on the bundled model"
"$bins/tiny-decoder" generate --device cuda -p "Once upon a time" -n 24 -t 0 --json 2>&1 | tail -n 2

if python3 -c "import torch, transformers" 2>/dev/null; then
    echo "== transformers on the same configs (random weights, greedy, sdpa)"
    python3 - <<'PY' 2>&1 | tee "$out/transformers.log"
import json, time, torch, transformers
for path in ["configs/bench-smollm135m.json", "configs/bench-smollm2-1.7b.json"]:
    cfg = transformers.LlamaConfig(**json.load(open(path)))
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    for dtype in [torch.float32, torch.bfloat16]:
        model = model.to(dtype)
        for p, n in [(128, 128), (1024, 32)]:
            ids = torch.randint(0, cfg.vocab_size, (1, p), device="cuda")
            with torch.no_grad():
                model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
                torch.cuda.synchronize(); t0 = time.time()
                model(ids); torch.cuda.synchronize(); t1 = time.time()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                torch.cuda.synchronize(); t2 = time.time()
            decode = n / max(t2 - t1 - (t1 - t0), 1e-9)
            print(f"transformers {path} {dtype} {p}+{n}: prefill {p / (t1 - t0):.0f} tok/s, "
                  f"decode {decode:.1f} tok/s")
    del model
PY
fi
