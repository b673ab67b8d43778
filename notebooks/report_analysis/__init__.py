"""The analysis behind notebooks/report.ipynb: reading the benchmark results, and every section's tables, plots
and sentences.

notebooks/report.py assembles the notebook from prose and one-line calls into this package, one per section
function below, in the report's order. Each section function takes ``R``, the loaded results
(:func:`load_results`: benchmark name -> its JSON document, the records typed by benchmarks/records.py), and
shows its output (``output.py``); it returns nothing. Every number shown is computed here from the results when
the notebook runs: nothing is typed in. Importing the package reads no result and draws nothing, so tests import
it on its own.

The modules, by concern: ``results`` (reading the results, their commits), ``formatting`` (units, HTML tables),
``output`` (where tables, sentences and figures go), then one module per part of the report: ``overview`` (0),
``allreduce`` (1), ``syncbn`` (2), ``data_parallel`` (3 and 4), ``cuda`` (5), ``torch_backend`` (6, 8 and
torch's test suite), ``hosts`` (7), ``crossing`` (7b), ``sharding`` (8b), ``recovery`` (9).
"""

from .allreduce import (
    allreduce_accuracy,
    allreduce_memory,
    allreduce_spread,
    allreduce_targets,
    allreduce_time,
    collective_checks,
    latency,
)
from .crossing import (
    compression,
    fault_tolerance_hosts,
    fault_tolerance_hosts_delayed,
    multihost_delayed,
    multihost_delayed_4x1,
    multihost_hosts,
    multihost_unshaped,
)
from .cuda import gpu
from .data_parallel import ddp, training
from .hosts import multihost, multihost_targets
from .overview import infrastructure, provenance
from .recovery import fault_tolerance
from .results import EXPECTED, OPTIONAL, SUITE, load_results, results_folder
from .sharding import sharding
from .syncbn import syncbn_local, syncbn_plot, syncbn_table
from .torch_backend import backend, torch_stack, torch_suite

__all__ = [
    "EXPECTED",
    "OPTIONAL",
    "SUITE",
    "load_results",
    "results_folder",
    # the sections, in the report's order
    "provenance",
    "infrastructure",
    "allreduce_time",
    "allreduce_targets",
    "allreduce_spread",
    "allreduce_accuracy",
    "allreduce_memory",
    "collective_checks",
    "latency",
    "syncbn_table",
    "syncbn_plot",
    "syncbn_local",
    "ddp",
    "training",
    "gpu",
    "backend",
    "multihost",
    "multihost_targets",
    "multihost_hosts",
    "multihost_unshaped",
    "compression",
    "fault_tolerance_hosts",
    "fault_tolerance_hosts_delayed",
    "multihost_delayed",
    "multihost_delayed_4x1",
    "torch_stack",
    "torch_suite",
    "sharding",
    "fault_tolerance",
]
