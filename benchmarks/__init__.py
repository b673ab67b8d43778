"""The benchmarks: each ``bench_*.py`` is a script (``.venv/bin/python benchmarks/bench_x.py``) that imports its
siblings by name; ``records.py`` (the results' typed records, pure Python) is also read as ``benchmarks.records``
by the report's analysis (notebooks/report_analysis), run from the repository's root."""
