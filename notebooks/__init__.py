"""The report: ``python -m notebooks.report`` (from the repository's root) builds and executes report.ipynb;
``report_analysis`` is its analysis."""
