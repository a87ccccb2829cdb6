"""Argument types the benchmarks share."""

from __future__ import annotations

import argparse


def positive_ints(text: str) -> list[int]:
    """ "8,16,32" -> [8, 16, 32]; anything else is an argparse error naming the value."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return out
