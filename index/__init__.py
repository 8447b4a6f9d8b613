"""Read side of a teralm index: tokens, documents and per-token match features, memory-mapped."""

from teralm.index.reader import Features, Index

__all__ = ["Index", "Features"]
