"""teralm: a compact transformer trained and served together with a longest-match index of its corpus."""

__version__ = "0.1.0"
