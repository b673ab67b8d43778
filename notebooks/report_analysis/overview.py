"""0. Provenance and infrastructure: the report's commit, and each result's date, software and machine."""

from __future__ import annotations

from IPython.display import Markdown

from .formatting import minute
from .output import display, table, warn
from .results import commit_of, provenance_problem, report_commit


def provenance(R: dict) -> None:
    """The report's commit, once, and a warning for each result not of it (or a sentence that every one is)."""
    display(Markdown(f"**These results were measured at commit `{report_commit(R)}`**, the commit of most of them."))
    problems = {name: provenance_problem(R, name) for name in R}
    for name, problem in problems.items():
        if problem:
            warn(f"`{name}.json`: {problem}.")
    if not any(problems.values()):
        display(Markdown("Every result comes from that commit, measured on a tree without uncommitted changes."))


def infrastructure(R: dict) -> None:
    """Each result's date, software, machine and commit, and a sentence on the all-reduce's machine."""
    rows = []
    for name, document in R.items():
        e = document["environment"]
        commit, dirty = commit_of(document)
        rows.append(
            {
                "benchmark": name,
                "date": minute(e["date"]),
                "torch": e["torch_version"],
                "backend": e["backend"],
                "device": e["device_type"],
                "host": e["hostname"],
                "CPU": f"{e['cpu_model']} × {e['cpu_count']}",
                "GPU": (e["gpu"] or {}).get("gpu_name", "none"),
                "commit": commit[:10] + (" + uncommitted changes" if dirty else ""),
            }
        )
    table(rows, ["benchmark", "date", "torch", "backend", "device", "host", "CPU", "GPU", "commit"])
    env = R["allreduce"]["environment"]
    gpu = env["gpu"]
    display(
        Markdown(
            f"Python {env['python_version']} on `{env['hostname']}`: {env['cpu_count']} cores of a {env['cpu_model']}, "
            + (
                f"{gpu['gpu_count']} × {gpu['gpu_name']} (driver {gpu['gpu_driver']}), collectives of CUDA tensors over "
                "NCCL."
                if gpu
                else f"no GPU, so torch's collectives run over {env['backend']} on loopback TCP, ddpkit's over its "
                f'shared-memory transport (`transport="auto"`), and world sizes above '
                f"{env['cpu_count']} oversubscribe the cores. On a GPU machine the same scripts run over NCCL, and the "
                "SyncBatchNorm baseline becomes torch.nn.SyncBatchNorm."
            )
        )
    )
