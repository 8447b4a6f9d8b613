#!/usr/bin/env bash
# End to end on the embedded default corpus (the Python standard library's .py files, no download):
# build the causal lookup index, verify it, show what the index tells about a document, train the
# tiny model with index lookup for a few minutes, and sample from it with and without the index.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
build-index stdlib --out runs/stdlib-index
teralm verify-index runs/stdlib-index --samples 32
python - <<'PY'
from teralm.index import Index

ix = Index.open("runs/stdlib-index")
doc = next(i for i in range(ix.num_documents) if ix.document_source(i).endswith("json/decoder.py"))
start, _ = ix.document_range(doc)
lo, hi = start + 1900, start + 2020
f = ix.features(lo - 1, hi - 1)  # features at t-1 predict the token at t
text = ix.tokens(lo, hi)
right = f.next_token == text
print(f"\n{ix.document_source(doc)}: where the index's lookup of the preceding context")
print("already named the next byte (^), as the model will see it in training:\n")
for a in range(0, hi - lo, 60):
    print("  " + ix.decode(text[a : a + 60]).replace("\n", "~"))
    print("  " + "".join("^" if r else " " for r in right[a : a + 60]))
print(f"\n{right.mean():.0%} of these bytes were named by the index; mean match length "
      f"{f.match_len.mean():.1f} bytes")
PY
echo
echo "teralm query runs/stdlib-index 'def __init__(self, '"
teralm query runs/stdlib-index "def __init__(self, "

echo
echo "teralm train --index runs/stdlib-index --out runs/stdlib-tiny --preset tiny --max-steps 120"
teralm train --index runs/stdlib-index --out runs/stdlib-tiny --preset tiny --max-steps 120 --resume
echo
teralm sample runs/stdlib-tiny --index runs/stdlib-index --prompt "    def __init__(self" --tokens 160
