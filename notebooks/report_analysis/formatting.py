"""Numbers, sizes and dates as the report writes them, and HTML tables of dict rows."""

from __future__ import annotations

import re
from html import escape


def minute(date: str) -> str:
    """An ISO date as "YYYY-MM-DD HH:MM"."""
    return date[:16].replace("T", " ")


def us(seconds: float) -> str:
    """Whole microseconds: "12 µs"."""
    return f"{seconds * 1e6:.0f} µs"


def us_tenths(seconds: float) -> str:
    """Microseconds to a tenth, for latencies of a few µs: "12.3 µs"."""
    return f"{seconds * 1e6:.1f} µs"


def ms(seconds: float) -> str:
    """Milliseconds to a tenth: "1.2 ms"."""
    return f"{seconds * 1e3:.1f} ms"


def step_time(seconds: float) -> str:
    """A time per step or call in the unit that reads best: ms from 1 ms up, whole µs below."""
    return ms(seconds) if seconds >= 1e-3 else us(seconds)


def call_time(seconds: float) -> str:
    """A time per call with a third significant digit, for times from a few µs to ms: "2.5 µs", "1.25 ms"."""
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def mib(size: float) -> str:
    """Bytes in MiB to a tenth."""
    return f"{size / 2**20:.1f} MiB"


def kib(size: float) -> str:
    """Bytes in whole KiB."""
    return f"{size / 2**10:.0f} KiB"


def ratio(x: float) -> str:
    """A ratio to two decimals: "0.85×"."""
    return f"{x:.2f}×"


def floats(n: int) -> str:
    """A vector's length as the targets name it: 1000 -> "1k", 16000000 -> "16M", others in full ("1,234")."""
    for unit, size in (("M", 10**6), ("k", 10**3)):
        if n >= size and n % size == 0:
            return f"{n // size:,}{unit}"
    return f"{n:,}"


def html_table(rows: list[dict], columns: list[str], formats: dict | None = None) -> str:
    """An HTML table of dict rows, one column per key in ``columns``. A missing or None value is an empty cell;
    ``formats`` maps a column to the function that writes its values; other floats get 3 significant digits,
    anything else ``str``. Values are not escaped: a cell may hold HTML."""
    formats = formats or {}

    def cell(row: dict, column: str) -> str:
        value = row.get(column)
        if value is None:
            return ""
        if column in formats:
            return formats[column](value)
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r, c)}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure_legend(axes) -> dict:
    """label -> handle of every line of ``axes``, each label once (its first handle), in drawing order: the
    entries of one legend for a figure whose panels do not all show every line."""
    legend = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    return legend


def code_html(text: str) -> str:
    """``text`` escaped for HTML, its `backquoted` spans as <code>."""
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", escape(text))
