#!/usr/bin/env bash
# The offline corpus behind the n-gram table and the distilled draft: Python's standard library (code,
# tests excluded) and every .md/.rst/.txt file over 5 kB on this machine outside the project (prose).
# Usage: benchmarks/make_corpus.sh [OUT_DIR]   (default /tmp/ngram-corpus)
set -euo pipefail
out="${1:-/tmp/ngram-corpus}"
mkdir -p "$out/code" "$out/prose"
stdlib="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
find "$stdlib" -name '*.py' -not -path '*/test/*' -not -path '*/tests/*' -not -path '*/site-packages/*' -print0 |
  while IFS= read -r -d '' f; do cp "$f" "$out/code/$(echo "${f#"$stdlib"/}" | tr / _)"; done
find / \( -path /proc -o -path /sys -o -path /work -o -path /tmp -o -path "$out" \) -prune -o \
  -type f \( -name '*.md' -o -name '*.rst' -o -name '*.txt' \) -size +5k -print0 2>/dev/null |
  while IFS= read -r -d '' f; do cp "$f" "$out/prose/$(echo "${f#/}" | tr / _)"; done
du -sh "$out/code" "$out/prose"
