"""7b. The compressed crossing: training with gradients that cross hosts in bfloat16 (compression.json), and
torchft's replica groups across hosts (fault_tolerance_hosts.json). 7c. Long, fat links: the same across delayed
links (multihost_delayed.json, multihost_delayed_4x1_16M.json, fault_tolerance_hosts_delayed.json)."""

from __future__ import annotations

import statistics

import matplotlib.pyplot as plt
from IPython.display import Markdown

from .formatting import ratio, step_time
from .hosts import link_label, multihost
from .output import command, display, table

COMM_HOOKS = {
    "none": "float32",
    "bf16_crossing": "bfloat16 across hosts (ddpkit.Options)",
    "bf16_compress": "torch's bf16_compress_hook",
}


def _missing(name: str, how: str) -> None:
    display(Markdown(f"No `{name}.json` in this results folder, so it is not shown: {how} measures it."))


def multihost_hosts(R: dict) -> None:
    """The all-reduce across three hosts and more (multihost_hosts.json), as section 7 shows two hosts."""
    multihost(R, "multihost_hosts")


def multihost_unshaped(R: dict) -> None:
    """The all-reduce across 2-8 hosts on unshaped links again, with the receiving windows and the small
    send buffers, the kernel's own buffers beside them, and the "ddpkit" backend's time split
    (multihost_unshaped.json)."""
    multihost(R, "multihost_unshaped")


def multihost_delayed(R: dict) -> None:
    """The all-reduce across delayed links (multihost_delayed.json): each link's send buffer chosen from its path
    against the small fixed buffer and the kernel's sizing, gloo beside."""
    multihost(R, "multihost_delayed")


def multihost_delayed_4x1(R: dict) -> None:
    """The ring's all-reduce at four hosts and 16M floats across delayed links, more calls than
    multihost_delayed.json's, with the hosts' default congestion control (BBR) and with reno
    (multihost_delayed_4x1_16M.json)."""
    multihost(R, "multihost_delayed_4x1_16M")


def compression(R: dict) -> None:
    """Fashion-MNIST across simulated hosts three ways, same seed: final accuracy against float32's and the loss
    curves; a sentence where the folder has no compression.json."""
    if "compression" not in R:
        return _missing("compression", "`sudo .venv/bin/python benchmarks/bench_compression.py`")
    command(R, "compression")
    records = R["compression"]["records"]
    table(
        [
            {
                "gradients": COMM_HOOKS.get(r.comm_hook, r.comm_hook),
                "hosts × ranks": r.topology,
                "final test accuracy": r.final_test_accuracy,
                "- float32 (points)": r.accuracy_minus_fp32_points,
                "final test loss": r.final_test_loss,
            }
            for r in records
        ],
        ["gradients", "hosts × ranks", "final test accuracy", "- float32 (points)", "final test loss"],
        {
            "final test accuracy": lambda v: f"{v:.2%}",
            "- float32 (points)": lambda v: f"{v:+.2f}",
            "final test loss": lambda v: f"{v:.4f}",
        },
    )
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for r in records:
        window = 20  # a running mean: one step's loss is one batch's
        curve = [statistics.fmean(r.loss_curve[max(0, i - window + 1) : i + 1]) for i in range(len(r.loss_curve))]
        ax.plot(curve, label=COMM_HOOKS.get(r.comm_hook, r.comm_hook), linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (rank 0, mean of 20)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)
    plt.tight_layout()
    plt.show()
    display(
        Markdown(
            "The runs are not interleaved and their times are not compared: this is their quality. Bar: the "
            "bfloat16 crossing within 0.3 points of float32's final accuracy."
        )
    )


# torchft across hosts: the result's name -> its command and targets.
FAULT_TOLERANCE_HOSTS = {
    "fault_tolerance_hosts": (
        "`sudo .venv/bin/python benchmarks/bench_fault_tolerance.py --hosts 4 --link 1gbit`",
        "ddpkit no slower than gloo uncompressed, ≤ 0.7× with the bfloat16 crossing",
    ),
    "fault_tolerance_hosts_delayed": (
        "`sudo .venv/bin/python benchmarks/bench_fault_tolerance.py --hosts 2 --link 1gbit-10ms "
        "--steady-wrappers torchft-ddp --name fault_tolerance_hosts_delayed`",
        "ddpkit no slower than gloo uncompressed, ≤ 0.6× with the bfloat16 crossing",
    ),
}


def fault_tolerance_hosts(R: dict, name: str = "fault_tolerance_hosts") -> None:
    """torchft's steady step with one replica group per simulated host: gloo, ddpkit, ddpkit with the bfloat16
    crossing; a sentence where the folder has no such result (`name`: FAULT_TOLERANCE_HOSTS's)."""
    how, targets = FAULT_TOLERANCE_HOSTS[name]
    if name not in R:
        return _missing(name, how)
    command(R, name)
    document = R[name]
    settings = document["settings"]
    rows = []
    for wrapper, figures in document["summary"].items():
        for candidate, seconds in figures["median_step_s"].items():
            rows.append(
                {
                    "candidate": candidate,
                    "wrapper": wrapper,
                    "median step": seconds,
                    "/ torchft on gloo": figures["over_gloo"][candidate],
                }
            )
    table(
        rows,
        ["candidate", "wrapper", "median step", "/ torchft on gloo"],
        {"median step": step_time, "/ torchft on gloo": ratio},
    )
    display(
        Markdown(
            f"{settings['hosts']} replica groups of one rank, one per simulated host, links at "
            f"{link_label(settings['link'])}; the 8.4M-parameter MLP, median over {settings['repeats']} interleaved "
            f"runs of each candidate's median step. Targets: {targets}."
        )
    )


def fault_tolerance_hosts_delayed(R: dict) -> None:
    """torchft's steady step across delayed links (fault_tolerance_hosts_delayed.json)."""
    fault_tolerance_hosts(R, "fault_tolerance_hosts_delayed")
