"""JSON-lines task files (LAMBADA, multiple choice): every line an object with the fields a task needs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UsageError


def read_jsonl(path: str | os.PathLike[str], flag: str, fields: dict[str, type]) -> list[dict]:
    """Every line of `path` as an object holding `fields` of the given types; UsageError naming the line."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {p}: no such file (expected JSON lines)")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {p}: not UTF-8 ({e.reason} at byte {e.start}); expected JSON lines") from None
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{flag} {p}: line {n} is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(doc, dict):
            raise UsageError(f"{flag} {p}: line {n} is a JSON {type(doc).__name__}, expected an object")
        for key, typ in fields.items():
            if key not in doc:
                raise UsageError(f"{flag} {p}: line {n} has no {key!r} field (expected {', '.join(fields)})")
            if typ is int and isinstance(doc[key], str) and doc[key].strip().isdecimal():
                doc[key] = int(doc[key])  # a label exported as text ("3"), which lm-eval reads with int()
            if not isinstance(doc[key], typ) or (typ is int and isinstance(doc[key], bool)):
                raise UsageError(
                    f"{flag} {p}: line {n}: {key!r} is a {type(doc[key]).__name__}, expected a {typ.__name__}"
                )
        doc["_line"] = n
        docs.append(doc)
    if not docs:
        raise UsageError(f"{flag} {p}: the file has no lines (expected one JSON object per line)")
    return docs
