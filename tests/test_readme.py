"""The code blocks of README.md and docs/*.md as a newcomer runs them after `make main`.

Every Python block runs as written, and so does every command of a bash block. A bash block that takes
minutes or needs what this machine lacks (two hosts, root, network) carries a marker instead, and its
commands are only checked: each names a program of the virtual environment or a make target, its
script exists, and the trainer accepts its options.

The markers are HTML comments on the line right above a block's fence (GitHub does not show them):

- ``<!-- not run: REASON -->`` above a bash block: checked, not run. Keep these few, each with its reason.
  A cluster launcher's command (``srun``, ``mpirun``) is checked as the program it launches.
- ``<!-- file: PATH -->`` above a Python block: the block is PATH's whole text, and PATH's own test runs
  it (the examples': tests/test_examples.py).

A Python block whose first line is ``# Save as NAME.py and run: COMMAND`` runs as that line says; any
other Python block runs as a script in one process. A YAML block is a Kubernetes manifest: it must parse,
and the trainer must accept its containers' options.

Besides: every relative link leads to a file and heading that exist, and every figure of the README's
results table is the one its benchmarks/results/ file holds.
"""

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpkit.training.cli import parse_args

from helpers import EXAMPLES, documented_commands, documented_mpirun, free_port

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README = (REPO / "README.md").read_text()
LANGUAGES = {"python", "bash", "text", "yaml"}
SAVE_AS = re.compile(r"# Save as (?P<name>\w+\.py) and run: (?P<command>.+)")
# Each one hides commands from the suite: raising this needs a reason that a reviewer accepts.
# docs/clusters.md's three need a SLURM cluster or several hosts (its one-host mpirun runs); docs/benchmarks.md's
# `make report` serves the notebook until stopped.
MOST_NOT_RUN = 14


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, from 1
    language: str
    text: str
    marker: str  # "not run", "file" or ""
    marker_value: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.fullmatch(r"```(\w*)\s*", lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
            marker = re.fullmatch(r"<!-- (not run|file): (.+?) -->", lines[i - 1].strip()) if i else None
            found.append(
                Block(
                    doc,
                    i + 1,
                    fence.group(1),
                    "".join(line + "\n" for line in lines[i + 1 : end]),
                    marker.group(1) if marker else "",
                    marker.group(2) if marker else "",
                )
            )
            i = end + 1
    return found


BLOCKS = blocks()
PYTHON = [b for b in BLOCKS if b.language == "python" and b.marker != "file"]


def commands(block: Block) -> list[list[str]]:
    """Every command of a bash block, as argv without its trailing comment."""
    found = []
    for line in block.text.splitlines():
        line = line.split("  #")[0].strip().removesuffix(" &")  # a process left running beside the next
        if line and not line.startswith("#"):
            found.append(shlex.split(line))
    return found


COMMANDS = [(block, argv) for block in BLOCKS if block.language == "bash" for argv in commands(block)]


def example_commands() -> set[tuple[str, ...]]:
    """The examples' own commands, as their docstrings give them and tests/test_examples.py runs them."""
    return {tuple(command) for path in EXAMPLES for command in documented_commands(path)}


def venv_program(argv: list[str]) -> list[str]:
    """argv with the virtual environment's programs as this interpreter runs them (the same programs
    when the suite runs from .venv, as `make test` does)."""
    program = {
        ".venv/bin/python": [sys.executable],
        ".venv/bin/torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }[argv[0]]
    return program + argv[1:]


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # torchrun's default port may be taken by another job on the machine; PET_MASTER_PORT is how torchrun
    # reads --master_port from the environment, so the command itself stays as written.
    env = {**os.environ, "PET_MASTER_PORT": str(free_port())}
    return subprocess.run(venv_program(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def test_the_first_two_commands_are_make_main_and_make_test():
    readme = [argv for block, argv in COMMANDS if block.doc.name == "README.md"]
    assert readme[:2] == [["make", "main"], ["make", "test"]]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_each_block_says_how_it_runs(block):
    assert block.language in LANGUAGES, f"{block.name}: a block needs one of {sorted(LANGUAGES)} after its fence"
    if block.marker == "not run":
        assert block.language == "bash" and block.marker_value.strip(), block.name
    if block.marker == "file":
        path = REPO / block.marker_value
        assert block.language == "python" and path.is_file(), block.name
        assert block.text == path.read_text(), f"{block.name}: not {block.marker_value} as it is now"
        assert path.parent == REPO / "examples", f"{block.name}: only the examples are run by a test of their own"
    if block.language == "python" and block.marker != "file":
        first = block.text.splitlines()[0]
        if first.startswith("# Save as"):
            assert SAVE_AS.fullmatch(first), f"{block.name}: '# Save as NAME.py and run: COMMAND'"


def test_few_blocks_are_not_run():
    not_run = [block.name for block in BLOCKS if block.marker == "not run"]
    assert len(not_run) <= MOST_NOT_RUN, not_run


@pytest.mark.parametrize("block", PYTHON, ids=lambda block: block.name)
def test_python_block_runs_as_written(block, tmp_path):
    saved = SAVE_AS.fullmatch(block.text.splitlines()[0])
    name = saved.group("name") if saved else "block.py"
    argv = shlex.split(saved.group("command")) if saved else [".venv/bin/python", name]
    assert argv[0] in (".venv/bin/python", ".venv/bin/torchrun") and argv[-1] == name, argv
    (tmp_path / name).write_text(block.text)
    # Run from the repository's root, where the doc's commands run, with the block saved elsewhere.
    result = run([*argv[:-1], str(tmp_path / name)], cwd=REPO)
    assert result.returncode == 0, f"{block.name}: {' '.join(argv)}\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("block, argv", COMMANDS, ids=[f"{b.name} {' '.join(argv)[:50]}" for b, argv in COMMANDS])
def test_each_command_runs_from_the_repository_as_written(block, argv):
    program = argv[0]
    if program == "make":
        assert re.search(rf"^{argv[1]}:", (REPO / "Makefile").read_text(), flags=re.MULTILINE)
        assert block.marker == "not run", "make's targets set up the whole environment: minutes"
        return
    if program == "bash":
        assert (REPO / argv[1]).is_file()
        assert block.marker == "not run", f"{argv}: run it, or mark its block"
        return
    if program.startswith("~/ddpkit-env/") or program == "python3":  # installing into an environment of one's own
        assert block.marker == "not run"
        return
    # docs/clusters.md: a launcher's options, then the program it launches, which is checked as any other.
    # The one-host mpirun runs in tests/test_launchers.py, against torchrun.
    run_elsewhere = program == "mpirun" and block.marker != "not run"
    if run_elsewhere:
        assert argv == documented_mpirun(), f"{block.name}: mark it, or make it the one tests/test_launchers.py runs"
    if program in ("srun", "mpirun"):
        argv = argv[next(i for i, arg in enumerate(argv) if arg.startswith(".venv/bin/")) :]
    if program == "sudo":  # root for the simulated hosts
        argv = argv[1:]
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # the command's environment
        argv = argv[1:]
    if argv[0] == ".venv/bin/torchft_lighthouse":  # torchft's, a server: docs/fault_tolerance.md
        assert block.marker == "not run", "the lighthouse runs until stopped"
        return
    # Anything else is the virtual environment's: after `make main`, nothing else has torch and ddpkit.
    assert argv[0] in (".venv/bin/python", ".venv/bin/torchrun"), f"{argv[0]}: say .venv/bin/{argv[0]}"
    scripts = [arg for arg in argv[1:] if arg.endswith(".py")]
    if argv[1:3] == ["-m", "pytest"]:
        assert all((REPO / path).is_file() for path in argv[3:] if path.startswith("tests/"))
    else:
        assert scripts and (REPO / scripts[0]).is_file(), argv
    if scripts and scripts[0] == "train.py" and "--help" not in argv:
        parse_args(argv[argv.index("train.py") + 1 :])  # exits (and fails the test) on an option it does not know
    if block.marker == "not run" or run_elsewhere:
        return
    if argv[0] == ".venv/bin/torchrun" and tuple(["torchrun", *argv[1:]]) in example_commands():
        return  # an example's own command: tests/test_examples.py runs it
    result = run(argv, cwd=REPO)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "yaml"], ids=lambda block: block.name)
def test_manifest_parses_and_runs_the_trainer_through_torchrun(block):
    yaml = pytest.importorskip("yaml")  # PyYAML: Ray's (make setup installs it)
    documents = {document["kind"]: document for document in yaml.safe_load_all(block.text)}
    job, service = documents["Job"], documents["Service"]
    pods = job["spec"]["template"]["spec"]
    assert pods["subdomain"] == service["metadata"]["name"] == service["spec"]["selector"]["job-name"]
    for container in pods["containers"]:
        argv = container["command"]
        assert argv[0] == ".venv/bin/torchrun" and argv[argv.index("--rdzv_backend") + 1] == "c10d", argv
        # the endpoint is the indexed job's first pod, under the headless service
        endpoint = f"{job['metadata']['name']}-0.{pods['subdomain']}:"
        assert argv[argv.index("--rdzv_endpoint") + 1].startswith(endpoint), argv
        assert argv[argv.index("--nnodes") + 1] == str(job["spec"]["completions"]) == str(job["spec"]["parallelism"])
        parse_args(argv[argv.index("train.py") + 1 :])


def test_training_commands_do_not_resume_each_others_runs():
    """A run continues the checkpoint in its --out directory and refuses one of other settings: commands
    that share a directory must train the same run (the nodes of one job), others need their own."""
    runs = {}
    for _, argv in COMMANDS:
        if "train.py" in argv and "--help" not in argv:
            config, _ = parse_args(argv[argv.index("train.py") + 1 :])
            runs.setdefault(config.out_dir, set()).add(repr(config))
    assert len(runs) >= 3, runs
    assert {out: configs for out, configs in runs.items() if len(configs) > 1} == {}


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)  # a '#' in a code block is no heading
    return {
        re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    }


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_links_lead_somewhere(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.is_file(), f"{doc.name}: {target}"
        assert not anchor or anchor in anchors(linked), f"{doc.name}: {target}: no such heading"


def results_table_rows() -> dict[str, list[str]]:
    """The README's results, each row's figures as benchmarks/results/*.json give them today."""

    def load(name):
        return json.loads((REPO / "benchmarks" / "results" / name).read_text())

    def spread(unit, digits, middle, low, high):
        scale = {"s": 1, "ms": 1e3}[unit]
        return f"{middle * scale:.{digits}f} {unit} [{low * scale:.{digits}f}, {high * scale:.{digits}f}]"

    training = load("training.json")
    runs = {r["candidate"]: r for r in training["records"]}
    epochs = {name: [e["epoch_time_s"] for e in runs[name]["epochs"]] for name in ("ddpkit", "torch")}
    allreduce = {
        r["candidate"]: r
        for r in load("allreduce.json")["records"]
        if r["kind"] == "time" and r["world_size"] == 2 and r["numel"] == 1_000_000
    }
    ddp = load("ddp.json")
    steps = {(r["model"], r["candidate"]): r for r in ddp["records"] if r["accumulation"] == 1}
    stack = load("torch_stack.json")
    fsdp = {r["candidate"]: r for r in stack["records"] if r["workload"] == "fsdp2" and r["world_size"] == 2}
    syncbn = [r["ratio"] for r in load("syncbn.json")["records"] if r["world_size"] == 2 and "ratio" in r]
    return {
        "training, Fashion-MNIST, 15 epochs": [
            *(spread("s", 1, statistics.median(e), min(e), max(e)) for e in epochs.values()),
            f"{training['summary']['epoch_time_ratio']:.2f}",
        ],
        "the same runs: final test accuracy": [
            *(f"{runs[name]['final_test_accuracy'] * 100:.2f} %" for name in ("ddpkit", "torch")),
            f"{training['summary']['accuracy_difference_pp']:.2f} points",
        ],
        "all-reduce of 1M floats": [
            *(spread("ms", 2, r["median_s"], r["p25_s"], r["p75_s"]) for r in (allreduce["ddpkit"], allreduce["gloo"])),
            f"{allreduce['ddpkit']['median_s'] / allreduce['gloo']['median_s']:.2f}",
        ],
        **{
            f"DDP step, {label}": [
                *(
                    spread("ms", digits, r["median_step_s"], r["p25_step_s"], r["p75_step_s"])
                    for r in (steps[model, "ddpkit"], steps[model, "torch"])
                ),
                f"{ddp['summary'][f'ddpkit {model} acc=1']['time_ratio']:.2f}",
            ]
            for model, label, digits in (("net", "template Net", 1), ("resnet18", "ResNet-18", 0))
        },
        "torch's FSDP2 step": [
            *(
                spread("ms", 0, r["median_step_s"], r["p25_step_s"], r["p75_step_s"])
                for r in (fsdp["ddpkit"], fsdp["gloo"])
            ),
            f"{stack['summary']['fsdp2 n=2: ddpkit/gloo time']:.2f}",
        ],
        "SyncBatchNorm forward+backward": [f"{min(syncbn):.2f} to {max(syncbn):.2f}"],
    }


def test_the_readme_results_are_the_committed_results():
    """Every figure of the README's results table is the committed benchmarks/results/ file's, rounded as
    shown: after a new benchmark run this fails, showing the row to update."""
    table = [line for line in README.splitlines() if line.startswith("| ")]
    for label, figures in results_table_rows().items():
        rows = [row for row in table if row.startswith(f"| {label}")]
        assert len(rows) == 1, f"the README's results table has no row '{label}'"
        cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
        assert [figure for figure in figures if not any(cell.startswith(figure) for cell in cells)] == [], rows[0]
    assert f"commit `{results_commit()}`" in README, "the README names the commit of its results"


def results_commit() -> str:
    """The one commit the README's results were measured at."""
    commits = {
        json.loads((REPO / "benchmarks" / "results" / name).read_text())["environment"]["git_commit"]
        for name in ("training.json", "allreduce.json", "ddp.json", "torch_stack.json", "syncbn.json")
    }
    assert len(commits) == 1, f"the README's results come from several commits: {commits}"
    return commits.pop()[:7]


def sharding_zero3_rows() -> dict[str, list[str]]:
    """docs/sharding.md's ZeRO-3 figures, each row's cells as benchmarks/results/sharding_zero3.json gives them."""
    document = json.loads((REPO / "benchmarks" / "results" / "sharding_zero3.json").read_text())
    timed = {
        (r.get("topology"), r["world_size"], r["model"], r["candidate"]): r
        for r in document["records"]
        if r.get("median_step_s") is not None
    }
    sent = {(r["world_size"], r["candidate"]): r for r in document["records"] if r["phase"] == "bytes"}
    rows = {}
    for topology, n, model, _ in sorted({k for k in timed if k[3] == "zero3"}, key=str):
        where = f"{topology} hosts" if topology else f"{n} ranks"
        of = {
            c: timed.get((topology, n, model, c))
            for c in ("zero3", "zero3_bf16", "ddpkit_ddp", "fsdp2_ddpkit", "fsdp2_gloo")
        }
        zero3, ddp = of["zero3"], of["ddpkit_ddp"]
        cells = [f"{zero3['median_step_s'] * 1e3:.0f} ms"]
        cells += [
            f"{zero3['median_step_s'] / of[c]['median_step_s']:.2f}"
            for c in ("ddpkit_ddp", "fsdp2_ddpkit", "fsdp2_gloo")
        ]
        cells.append(f"{of['zero3_bf16']['median_step_s'] / ddp['median_step_s']:.2f}")
        cells.append(f"{zero3['model_state_bytes_per_param']:.2f} ({zero3['expected_bytes_per_param']:g})")
        cells.append(f"{zero3['peak_rss_bytes'] / ddp['peak_rss_bytes']:.2f}")
        cells.append(f"{zero3['peak_rss_increase_bytes'] / ddp['peak_rss_increase_bytes']:.2f}")
        rows[f"{where}, {model}"] = cells
    for n in sorted({n for n, _ in sent}):
        rows[f"bytes sent per step, {n} ranks"] = [
            f"{sent[(n, c)]['bytes_sent_per_step'] / sent[(n, 'ddpkit_ddp')]['bytes_sent_per_step']:.2f}"
            for c in ("zero3", "zero3_bf16")
        ] + [
            f"{sent[(n, 'zero3_bf16')]['gather_bytes_per_forward'] / sent[(n, 'zero3')]['gather_bytes_per_forward']:.3f}"
        ]
    return rows


def test_the_sharding_page_shows_the_committed_zero3_results():
    """docs/sharding.md's ZeRO-3 table is the committed sharding_zero3.json's, rounded as shown: after a new
    benchmark run this fails, showing the row to update."""
    page = (REPO / "docs" / "sharding.md").read_text()
    table = [line for line in page.splitlines() if line.startswith("| ")]
    for label, figures in sharding_zero3_rows().items():
        rows = [row for row in table if row.startswith(f"| {label} |")]
        assert len(rows) == 1, f"docs/sharding.md's ZeRO-3 table has no row '{label}'"
        cells = [cell.strip() for cell in rows[0].strip("|").split("|")][1:]
        assert cells == figures, rows[0]
    commit = json.loads((REPO / "benchmarks" / "results" / "sharding_zero3.json").read_text())["environment"]
    assert f"commit `{commit['git_commit'][:7]}`" in page, "docs/sharding.md names the commit of its ZeRO-3 results"
