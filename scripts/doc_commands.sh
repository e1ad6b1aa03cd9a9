#!/usr/bin/env bash
# Run every runnable shell block of the docs, as written, and say which one failed.
#
#   scripts/doc_commands.sh [FILE.md ...]        (default: README.md docs/*.md)
#
# Blocks fenced ```sh need only a fresh clone and `cargo build --release`; blocks fenced
# ```sh smollm2 also need SmolLM2 from scripts/build_smollm2.sh and are skipped, visibly,
# when it is not built (TINY_DECODER_REQUIRE_SMOLLM2=1 makes that a failure). Other fences
# (bash, console, text, python, ...) are never run. docs/testing.md describes the convention.
#
# Each block runs on its own with `bash -euo pipefail` from the repository root, stdin from
# /dev/null, under `timeout $DOC_TIMEOUT` (default 600 s). One line per block; a failed
# block's output is printed; the exit status is non-zero and the last line names the
# file:line of the first block that failed.
set -euo pipefail
cd "$(dirname "$0")/.."

limit="${DOC_TIMEOUT:-600}"
bin=target/release/tiny-decoder
models="${TINY_DECODER_SMOLLM2:-target/models}"

if [ ! -x "$bin" ]; then
    echo "doc_commands: $bin is missing: run cargo build --release first" >&2
    exit 2
fi
# SmolLM2 is there when both directories are complete and the GGUF is beside them.
smollm2=yes
for d in "$models/smollm2-135m-instruct" "$models/smollm2-135m-instruct-bf16"; do
    [ -f "$d/.complete" ] || smollm2=no
done
[ -f "$models/SmolLM2-135M-Instruct.Q4_1.gguf" ] || smollm2=no
if [ "$smollm2" = no ] && [ -n "${TINY_DECODER_REQUIRE_SMOLLM2:-}" ]; then
    echo "doc_commands: SmolLM2 is not built in $models and TINY_DECODER_REQUIRE_SMOLLM2 is set" \
        "(run scripts/build_smollm2.sh)" >&2
    exit 1
fi

if [ "$#" -gt 0 ]; then
    files=("$@")
else
    files=(README.md docs/*.md)
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Extract the blocks: one file per block, and an index line "N<TAB>KIND<TAB>FILE:LINE"
# (LINE: the opening fence). KIND is sh or smollm2.
for f in "${files[@]}"; do
    [ -f "$f" ] || { echo "doc_commands: no such file: $f" >&2; exit 2; }
    n0=0
    [ ! -f "$work/index" ] || n0=$(wc -l <"$work/index")
    awk -v file="$f" -v dir="$work" -v n="$n0" '
        !inblock && /^```sh[ \t]*$/          { inblock = 1; kind = "sh"; start = FNR; next }
        !inblock && /^```sh[ \t]+smollm2[ \t]*$/ { inblock = 1; kind = "smollm2"; start = FNR; next }
        !inblock && /^```/                   { inblock = 2; start = FNR; next }
        inblock == 2 && /^```[ \t]*$/        { inblock = 0; next }
        inblock == 2                         { next }
        inblock == 1 && /^```[ \t]*$/ {
            inblock = 0; n++
            name = sprintf("%s/%04d.sh", dir, n)
            # The trap names the failing command and its line in the document.
            printf "trap %secho \"failed at %s:$((%d + LINENO - 1)): $BASH_COMMAND\" >&2%s ERR\n%s", \
                "\047", file, start, "\047", body > name
            close(name)
            printf "%04d\t%s\t%s:%d\n", n, kind, file, start >> (dir "/index")
            body = ""; next
        }
        inblock == 1 { body = body $0 "\n" }
        END { if (inblock) { printf "doc_commands: %s: unclosed fence at line %d\n", file, start > "/dev/stderr"; exit 1 } }
    ' "$f"
done
[ -f "$work/index" ] || { echo "doc_commands: no runnable blocks found"; exit 0; }

first_failure=""
passed=0 failed=0 skipped=0
start_all=$(date +%s)
while IFS=$'\t' read -r n kind where; do
    if [ "$kind" = smollm2 ] && [ "$smollm2" = no ]; then
        echo "skip  $where  (sh smollm2: SmolLM2 is not built in $models; scripts/build_smollm2.sh)"
        skipped=$((skipped + 1))
        continue
    fi
    t0=$(date +%s.%N)
    if timeout --kill-after=10 "$limit" bash -euo pipefail "$work/$n.sh" \
        </dev/null >"$work/$n.log" 2>&1; then
        status=0
    else
        status=$?
    fi
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [ "$status" -eq 0 ]; then
        echo "ok    $where  ($kind, ${secs} s)"
        passed=$((passed + 1))
    else
        reason="exit $status"
        [ "$status" -eq 124 ] && reason="timed out after ${limit} s"
        echo "FAIL  $where  ($kind, ${secs} s, $reason); its output:"
        sed 's/^/    | /' "$work/$n.log" | tail -n 40
        failed=$((failed + 1))
        [ -n "$first_failure" ] || first_failure="$where"
    fi
done <"$work/index"

total=$(( $(date +%s) - start_all ))
echo "doc_commands: $passed passed, $failed failed, $skipped skipped in ${total} s"
if [ -n "$first_failure" ]; then
    echo "doc_commands: first failure: $first_failure" >&2
    exit 1
fi
