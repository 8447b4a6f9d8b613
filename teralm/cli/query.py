"""``teralm query INDEX TEXT``: the longest match of a text, its next tokens and its sources."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from teralm.cli.common import fail
from teralm.errors import TeralmError

if TYPE_CHECKING:
    import numpy as np

    from teralm.index import Index


def add_parser(sub) -> None:
    q = sub.add_parser("query", help="longest match, next tokens and sources of a text")
    q.add_argument("index", type=Path)
    q.add_argument("text")
    q.add_argument("--top", type=int, default=5, help="continuations to show")
    q.add_argument("--sources", type=int, default=3, help="documents to show")
    q.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from teralm.index import Index

    try:
        ix = Index.open(args.index)
        # the argument's bytes as given (Python hands bytes that are not UTF-8 over as surrogates)
        print_query(ix, ix.encode(os.fsencode(args.text)), args.top, args.sources)
    except UnicodeDecodeError:
        return fail("teralm query", "the text is not valid UTF-8, which a BPE index needs")
    except TeralmError as e:
        return fail("teralm query", str(e))
    return 0


def print_query(ix: Index, context: np.ndarray, top: int, sources: int) -> None:
    """The longest match of ``context``, its next tokens and the documents that hold it."""
    found = ix.query.lookup(context, top_k=top, sources=sources)
    length, count = found.length, found.count
    matched = ix.decode(context[len(context) - length :]) if length else ""
    print(f"longest match: {length} of {len(context)} tokens, {count:,} occurrences: {matched!r}")
    if len(found.tokens):
        print("next token      probability   count")
    for token, n in zip(found.tokens, found.counts):
        print(f"  {ix.decode([int(token)])!r:<14} {n / count:10.3f} {n:8,}")
    for hit in found.documents:
        snippet = " ".join(hit["snippet"].split())
        print(f"[doc {hit['document']}] {hit['source']} @ {hit['offset']}: {snippet[:100]!r}")
