"""Text from elsewhere (a rank's message, an incident folder that may be crafted), as people see it."""

from __future__ import annotations

from typing import Any


def printable(text: Any) -> str:
    """``str(text)`` with every character that ``str.isprintable()`` refuses (C0 and C1 controls,
    DEL, line breaks, format and bidi controls, lone surrogates) written as ``\\xNN``, ``\\uNNNN``
    or ``\\UNNNNNNNN``: what a terminal, a log line or a table shows without being driven by it."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
