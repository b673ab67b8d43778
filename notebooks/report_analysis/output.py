"""Where a section's output goes: every table, sentence and warning passes through ``display`` (IPython's),
every figure through matplotlib's ``plt.show``; tests/test_report_analysis.py catches both to read what a
section shows."""

from __future__ import annotations

import IPython.display
from IPython.display import HTML, Markdown

from .formatting import html_table, minute
from .results import provenance_problem


def display(item) -> None:
    """Shows ``item`` (an IPython ``Markdown`` or ``HTML``) under the running cell."""
    IPython.display.display(item)


def warn(text: str) -> None:
    """Shows ``text`` (markdown-free HTML) as a warning box, marked ⚠."""
    display(
        HTML(
            f'<div style="border-left: 6px solid #d9822b; background: #fff4e5; padding: 6px 12px; '
            f'margin: 6px 0">⚠ {text}</div>'
        )
    )


def command(R: dict, name: str) -> None:
    """A section's first line: the command that produced result ``name`` and when; a warning under it where the
    result is not of the report's commit."""
    env = R[name]["environment"]
    display(Markdown(f"Produced by `{env['command']}` on {minute(env['date'])} UTC."))
    problem = provenance_problem(R, name)
    if problem:
        warn(
            f"`{name}.json`: {problem}. Run `bash benchmarks/run_all.sh` on a clean checkout to measure every "
            "result from one commit."
        )


def table(rows: list[dict], columns: list[str], formats: dict | None = None) -> None:
    """Shows :func:`html_table`'s table."""
    display(HTML(html_table(rows, columns, formats)))
