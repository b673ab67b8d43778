"""What ddpkit's backend autoload entry point adds to ``import torch`` (python/_ddpkit_autoload).

    python benchmarks/bench_import.py             # 20 imports of each: about 1 minute
    python benchmarks/bench_import.py --quick     # a smoke run

Each measurement is a fresh interpreter that times its own ``import torch`` (the interpreter's start is not
counted), with torch's backend autoload on (torch reads its entry points and calls ddpkit's ``register``) or
off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``: torch reads no entry point). The two alternate in a rotating order
(``common.interleave``, 2 warm-up repetitions dropped); the figure is each one's median, and the summary
gives the difference and the ratio of the medians. Each child also says whether ddpkit's C++ extension was
loaded once ``import torch`` returned (it must not be). Results: benchmarks/results/import_torch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from records import ImportTimeRecord  # noqa: E402

CANDIDATES = {"autoload": "1", "no_autoload": "0"}
CHILD = (
    "import sys, time\n"
    "start = time.perf_counter()\n"
    "import torch\n"
    "seconds = time.perf_counter() - start\n"
    "print(seconds, 'ddpkit._C' in sys.modules)\n"
)


def import_once(candidate: str) -> tuple[float, bool]:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": CANDIDATES[candidate]}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True).stdout
    seconds, loaded = out.split()
    return float(seconds), loaded == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 repetitions, results in the quick folder")
    args = parser.parse_args()
    reps = 3 if args.quick else args.reps
    results = common.interleave(list(CANDIDATES), reps, import_once, warmup=2)
    records = []
    for candidate, measured in results.items():
        times = [seconds for seconds, _ in measured]
        p25, _, p75 = statistics.quantiles(times, n=4)
        records.append(
            ImportTimeRecord(
                candidate=candidate,
                median_s=statistics.median(times),
                p25_s=p25,
                p75_s=p75,
                reps=reps,
                extension_loaded=any(loaded for _, loaded in measured),
            )
        )
        print(f"{candidate:12s} median {records[-1].median_s * 1e3:7.1f} ms  [{p25 * 1e3:.1f}, {p75 * 1e3:.1f}]")
    on, off = (r.median_s for r in records)
    summary = {"autoload_minus_no_autoload_ms": (on - off) * 1e3, "autoload_over_no_autoload": on / off}
    print(json.dumps(summary))
    path = common.write_results(
        "import_torch",
        backend="ddpkit",
        device_type="cpu",
        settings={"reps": reps, "warmup": 2},
        records=records,
        summary=summary,
        quick=args.quick,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
