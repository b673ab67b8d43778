"""torch's distributed test suite on gloo and on "ddpkit", side by side (issue 25, item 5).

    .venv/bin/python scripts/run_torch_suite.py                       # the whole suite on both backends
    .venv/bin/python scripts/run_torch_suite.py --tests test_barrier test_all_reduce_sum   # a few tests
    .venv/bin/python scripts/run_torch_suite.py --backends ddpkit --output /tmp/x.json    # one backend

Each backend runs in a process of its own (``tests/torch_suite.py`` with ``BACKEND`` set: its
``TestDistBackendWithFork``, world size 2), one test after another, each test's ranks forked from
that process and killed after ``--test-timeout`` seconds. The outcome of every test (passed,
failed, error, skipped with its reason, its duration, a failure's last exception line) is
appended to a JSON-lines log as it ends, so a run killed halfway keeps what it measured.

Then the two runs are compared: every test that passes on gloo and does not pass on "ddpkit" is a
difference, and ``REASONS`` below says why (read from the test's failure: a ``ddpkit bug`` or a
reason that is ``torch``'s own, named); a test that fails on one backend only is first run once more
(``--reruns``), and one that passes then is listed as flaky, not as a difference (the machine is
shared: the suite's own file barrier gives up after 10 s). A difference that ``REASONS`` does not know is written as
``unclassified`` and the script exits with status 1: read the failure and add it. Results:
``docs/torch_suite.json`` (every test's outcome on both backends, the differences,
the run's duration) and ``docs/torch_suite.md`` (the table of differences); with ``--tests`` or
``--output`` the default files are left alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# (not in benchmarks/results/: every file there holds typed benchmark records, tests/test_bench_records.py)
RESULTS = REPO_ROOT / "docs" / "torch_suite.json"
TABLE = REPO_ROOT / "docs" / "torch_suite.md"
BACKENDS = ("gloo", "ddpkit")

# Why a test that passes on gloo does not pass on "ddpkit": test name -> kind, reason, and the text its
# failure on ddpkit shows (tests/test_torch_suite.py checks that it still fails with it). kind is "torch"
# (the cause is torch's own: ddpkit cannot change it) or "ddpkit bug" (to be fixed in ddpkit).
REASONS: dict[str, dict[str, str]] = {
    "test_ddp_logging_data_cpu": {
        "kind": "torch",
        "reason": 'DDP\'s logger records `ProcessGroup::getBackendName()`, which c10d reports as "custom" for every '
        "third-party backend (`BackendType::CUSTOM`), while the test expects `dist.get_backend()`, "
        '"ddpkit".',
        "message": "'custom' != 'ddpkit'",
    },
    "test_monitored_barrier_gloo": {
        "kind": "torch",
        "reason": "`dist.monitored_barrier` refuses every backend but gloo by name, in Python "
        "(`distributed_c10d.monitored_barrier`), before the backend is reached.",
        "message": "monitored_barrier is only implemented for GLOO backend",
    },
    "test_monitored_barrier_gloo_subgroup": {
        "kind": "torch",
        "reason": "As `test_monitored_barrier_gloo`: `dist.monitored_barrier` refuses every backend but gloo by name.",
        "message": "monitored_barrier is only implemented for GLOO backend",
    },
}


# --- one backend (the child process) ---------------------------------------------------------------


def _summary(text: str) -> str:
    """A failure's exception line: the first failing rank's last one (a rank's traceback comes inside the
    parent's RuntimeError "Process N exited with error code 10 and exception: ..."; a later rank's error
    is often only the consequence of the first one's), else the text's last one."""
    blocks = re.split(r"Process \d+ exited with error code \d+ and exception:", text)
    block = blocks[1] if len(blocks) > 1 else text
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    exception = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Timeout|Interrupt|Failure)|AssertionError|SkipTest)\b.*")
    candidates = [line for line in lines if exception.match(line)]
    return (candidates[-1] if candidates else lines[-1] if lines else "")[:400]


def run_backend(backend: str, tests: list[str] | None, log: Path) -> None:
    """Runs in the child: ``tests`` (default: all) of the suite on ``backend``; one JSON line per test."""
    os.environ["BACKEND"] = backend
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import unittest

    import torch_suite

    names = tests or torch_suite.test_names()

    class Result(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.outcome: tuple[str, str, str] = ("passed", "", "")

        def addError(self, test, err):
            text = self._exc_info_to_string(err, test)
            self.outcome = ("error", _summary(text), text[:4000])

        def addFailure(self, test, err):
            text = self._exc_info_to_string(err, test)
            self.outcome = ("failed", _summary(text), text[:4000])

        def addSkip(self, test, reason):
            self.outcome = ("skipped", reason, "")

        def addExpectedFailure(self, test, err):
            self.outcome = ("xfailed", _summary(self._exc_info_to_string(err, test)), "")

        def addUnexpectedSuccess(self, test):
            self.outcome = ("xpassed", "", "")

    with open(log, "a") as handle:
        for name in names:
            result = Result()
            start = time.perf_counter()
            torch_suite.TestDistBackendWithFork(name).run(result)
            outcome, summary, detail = result.outcome
            record = {
                "test": name,
                "outcome": outcome,
                "seconds": round(time.perf_counter() - start, 3),
                "summary": summary,
                "detail": detail,
            }
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            print(
                f"[{backend}] {name}: {outcome} ({record['seconds']:.1f} s){' ' + summary if summary else ''}",
                file=sys.__stdout__,
                flush=True,
            )


# --- both backends (the parent) ------------------------------------------------------------------------


def measure(backend: str, tests: list[str] | None, test_timeout: int, budget: float, quiet: bool) -> dict:
    """Runs one backend's child; returns {test: record} and the child's wall time."""
    with tempfile.TemporaryDirectory(prefix=f"torch_suite_{backend}_") as tmp:
        log = Path(tmp) / "outcomes.jsonl"
        log.touch()
        env = dict(
            os.environ,
            BACKEND=backend,
            WORLD_SIZE="2",
            DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(test_timeout),
            PYTORCH_PRINT_REPRO_ON_FAILURE="0",
            PYTHONUNBUFFERED="1",
        )
        command = [sys.executable, __file__, "--child", backend, "--log", str(log)]
        if tests:
            command += ["--tests", *tests]
        start = time.perf_counter()
        rank_log = Path(tmp) / "ranks.log"
        with open(rank_log, "w") as ranks_output:
            # The ranks' logging (stderr) goes to a file; the child's one line per test comes to this console.
            process = subprocess.Popen(
                command,
                env=env,
                cwd=REPO_ROOT,
                stdout=None if not quiet else subprocess.DEVNULL,
                stderr=ranks_output,
                start_new_session=True,
            )
            try:
                returncode = process.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
                returncode = None
        wall = time.perf_counter() - start
        records = {}
        for line in log.read_text().splitlines():
            record = json.loads(line)
            records[record.pop("test")] = record
        if returncode != 0:
            tail = rank_log.read_text()[-2000:]
            print(
                f"torch_suite: the {backend} run ended with {returncode!r} after {len(records)} tests; its log's end:\n"
                f"{tail}",
                file=sys.stderr,
            )
        return {"records": records, "seconds": wall, "returncode": returncode}


def to_rerun(runs: dict) -> dict:
    """{backend: tests to run again}: with both backends, a test that failed on one and passed on the other;
    with one, every test that failed."""
    failing = {
        backend: {name for name, record in run["records"].items() if record["outcome"] in ("failed", "error")}
        for backend, run in runs.items()
    }
    if set(runs) != set(BACKENDS):
        return {backend: sorted(names) for backend, names in failing.items() if names}
    passing = {
        backend: {name for name, record in run["records"].items() if record["outcome"] == "passed"}
        for backend, run in runs.items()
    }
    other = {"gloo": "ddpkit", "ddpkit": "gloo"}
    return {
        backend: sorted(failing[backend] & passing[other[backend]])
        for backend in BACKENDS
        if failing[backend] & passing[other[backend]]
    }


def rerun(runs: dict, args) -> float:
    """Runs ``to_rerun``'s tests once more; a record whose outcome changes keeps the first as ``first_outcome``
    and ``first_summary`` (a test that passes only on its second run is flaky, not a difference)."""
    start = time.perf_counter()
    for backend, names in to_rerun(runs).items():
        print(f"torch_suite: {backend}: running again {', '.join(names)}", flush=True)
        again = measure(backend, names, args.test_timeout, args.budget, args.quiet)["records"]
        for name in names:
            first, second = runs[backend]["records"][name], again.get(name)
            if second is None:
                continue
            first["ran_twice"] = True
            if second["outcome"] != first["outcome"]:
                runs[backend]["records"][name] = {
                    **second,
                    "ran_twice": True,
                    "first_outcome": first["outcome"],
                    "first_summary": first["summary"],
                }
        runs[backend]["counts"] = counts(runs[backend]["records"])
    return time.perf_counter() - start


def flaky(runs: dict) -> list[dict]:
    return [
        {
            "backend": backend,
            "test": name,
            "first_outcome": record["first_outcome"],
            "first_summary": record["first_summary"],
        }
        for backend, run in runs.items()
        for name, record in sorted(run["records"].items())
        if "first_outcome" in record
    ]


def compare(runs: dict) -> list[dict]:
    """Every test gloo passes and ddpkit does not, with its outcome on ddpkit and the reason."""
    gloo, ddpkit = runs["gloo"]["records"], runs["ddpkit"]["records"]
    rows = []
    for name, record in sorted(gloo.items()):
        if record["outcome"] != "passed" or name not in ddpkit or ddpkit[name]["outcome"] == "passed":
            continue
        known = REASONS.get(name, {"kind": "unclassified", "reason": "not yet read: see the failure"})
        rows.append(
            {
                "test": name,
                "ddpkit_outcome": ddpkit[name]["outcome"],
                "ddpkit_summary": ddpkit[name]["summary"],
                "kind": known["kind"],
                "reason": known["reason"],
            }
        )
    return rows


def counts(records: dict) -> dict:
    result: dict = {}
    for record in records.values():
        result[record["outcome"]] = result.get(record["outcome"], 0) + 1
    return dict(sorted(result.items()))


def markdown(document: dict) -> str:
    runs, rows = document["runs"], document["differences"]
    total = document["tests"]
    lines = [
        '# torch\'s distributed test suite on "ddpkit" and on gloo',
        "",
        f"Written by `scripts/run_torch_suite.py` at commit `{document['git_commit']}` ({document['date']}), ddpkit built "
        f"from `{document['ddpkit_commit']}`, torch "
        f"{document['torch_version']}, world size 2, on {document['cpu_count']} CPU cores. The suite is "
        "`torch.testing._internal.distributed.distributed_test` (`TestDistBackend`, `DistributedTest._DistTestBase`), run "
        'by `tests/torch_suite.py` with forked ranks; "ddpkit" is in the suite\'s `plugin`, `ddp` and `subgroup` feature '
        "sets and its literal gloo gates are opened (see that module). Every result is in "
        "`docs/torch_suite.json`.",
        "",
        "| backend | tests | passed | failed / error | skipped | run time |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for backend in BACKENDS:
        c = runs[backend]["counts"]
        lines.append(
            f"| {backend} | {total} | {c.get('passed', 0)} | {c.get('failed', 0) + c.get('error', 0)} | "
            f"{c.get('skipped', 0)} | {runs[backend]['seconds'] / 60:.1f} min |"
        )
    lines += [
        "",
        f"Both runs one after the other: {document['seconds'] / 60:.1f} minutes (then "
        f"{document['rerun_seconds']:.0f} s to run the tests that failed on one backend only once more). Command: "
        '`.venv/bin/python scripts/run_torch_suite.py`; CI runs every test gloo passes here on "ddpkit" '
        "(`tests/test_torch_suite.py`, about a minute).",
        "",
        '## Every test gloo passes and "ddpkit" does not',
        "",
    ]
    if not rows:
        lines.append("None.")
    else:
        lines += ["| test | on ddpkit | why | cause |", "|---|---|---|---|"]
        for row in rows:
            summary = row["ddpkit_summary"].replace("|", "\\|")
            lines.append(
                f"| `{row['test']}` | {row['ddpkit_outcome']}: `{summary}` | {row['reason']} | {row['kind']} |"
            )
    if document.get("flaky"):
        lines += [
            "",
            "## Failed once, passed when run again",
            "",
            "A test that fails on one backend and passes on the other is run again once; these passed then "
            "(the machine was shared and loaded while the suite ran).",
            "",
            "| backend | test | first run |",
            "|---|---|---|",
        ]
        for row in document["flaky"]:
            summary = row["first_summary"].replace("|", "\\|")
            lines.append(f"| {row['backend']} | `{row['test']}` | {row['first_outcome']}: `{summary}` |")
    lines.append("")
    return "\n".join(lines)


def _git_commit() -> str:
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--tests", nargs="+", help="test names (default: the whole suite)")
    parser.add_argument("--test-timeout", type=int, default=120, help="seconds before a test's ranks are killed (120)")
    parser.add_argument("--budget", type=float, default=3600, help="seconds one backend's run may take in all (3600)")
    parser.add_argument(
        "--output",
        type=Path,
        help="results file (default docs/torch_suite.json and "
        "docs/torch_suite.md; not written with --tests unless given)",
    )
    parser.add_argument("--quiet", action="store_true", help="no line per test")
    parser.add_argument(
        "--reruns",
        type=int,
        choices=(0, 1),
        default=1,
        help="run a failure once more (1, the default): with both backends, a test that fails on "
        "one only; with one, every failure. A test that passes then is reported as flaky",
    )
    parser.add_argument(
        "--ddpkit-commit",
        help="the commit the ddpkit under test was built from, when it is not "
        "this tree (recorded; default: this tree's commit)",
    )
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_backend(args.child, args.tests, args.log)
        # Every outcome is in the log: leave without the interpreter's teardown, which crashed (SIGSEGV)
        # after a whole gloo run, in torch's threads.
        sys.stdout.flush()
        os._exit(0)

    import ddpkit._C
    import torch

    import ddpkit

    start = time.perf_counter()
    runs = {}
    for backend in args.backends:
        run = measure(backend, args.tests, args.test_timeout, args.budget, args.quiet)
        run["counts"] = counts(run["records"])
        runs[backend] = run
        print(f"torch_suite: {backend}: {run['counts']} in {run['seconds']:.0f} s", flush=True)
    seconds = time.perf_counter() - start
    rerun_seconds = rerun(runs, args) if args.reruns else 0.0
    document = {
        "benchmark": "torch_suite",
        "git_commit": _git_commit(),
        "ddpkit_commit": args.ddpkit_commit or _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        # which ddpkit ran (a build of another commit may come first on PYTHONPATH)
        "ddpkit_module": ddpkit.__file__,
        "ddpkit_extension": ddpkit._C.__file__,
        "cpu_count": os.cpu_count(),
        "world_size": 2,
        "test_timeout_s": args.test_timeout,
        "tests": max((len(run["records"]) for run in runs.values()), default=0),
        "seconds": round(seconds, 1),  # the runs, without the second runs of failures
        "rerun_seconds": round(rerun_seconds, 1),
        "runs": {
            backend: {
                "seconds": round(run["seconds"], 1),
                "returncode": run["returncode"],
                "counts": run["counts"],
                "records": run["records"],
            }
            for backend, run in runs.items()
        },
        "differences": compare(runs) if set(runs) == set(BACKENDS) else [],
        "flaky": flaky(runs),
    }
    # A passing test's record needs no detail; keep the committed file small.
    for run in document["runs"].values():
        for record in run["records"].values():
            if record["outcome"] in ("passed", "skipped") or not record["detail"]:
                record.pop("detail", None)
    rows = document["differences"]
    output = args.output or (None if args.tests else RESULTS)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(document, indent=1) + "\n")
        if set(runs) == set(BACKENDS):
            table = TABLE if args.output is None else output.with_suffix(".md")
            table.parent.mkdir(parents=True, exist_ok=True)
            table.write_text(markdown(document))
            print(
                f"torch_suite: wrote {output.relative_to(REPO_ROOT) if output.is_relative_to(REPO_ROOT) else output} "
                f"and {table.relative_to(REPO_ROOT) if table.is_relative_to(REPO_ROOT) else table}"
            )

    print()
    for backend, run in runs.items():
        print(f"{backend:>7}: {run['counts']}  ({run['seconds'] / 60:.1f} min)")
    print(f"both: {seconds / 60:.1f} min; gloo passes and ddpkit does not: {len(rows)}")
    for row in rows:
        print(f"  {row['test']}: {row['ddpkit_outcome']} [{row['kind']}] {row['ddpkit_summary']}")
    unclassified = [row["test"] for row in rows if row["kind"] == "unclassified"]
    if unclassified:
        print(
            f"torch_suite: unclassified differences (add them to REASONS): {', '.join(unclassified)}", file=sys.stderr
        )
    failed_runs = [backend for backend, run in runs.items() if run["returncode"] != 0]
    return 1 if unclassified or failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
