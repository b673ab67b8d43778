"""Builds notebooks/report.ipynb from the benchmark results and executes it headless.

    python -m notebooks.report                                   # benchmarks/results -> notebooks/report.ipynb
    python -m notebooks.report --results DIR --output PATH       # e.g. the --quick results of run_all.sh

Run it from the repository's root, as a module: the analysis imports ``benchmarks.records`` as a package.
The notebook itself runs wherever its kernel starts: Jupyter's front ends start it in notebooks/, this
script at the root, and its first cell finds the root from there (SETUP).

The notebook reads ``<results>/*.json`` (schema: benchmarks/README.md), their records as the
typed records of benchmarks/records.py (``r.median_s``), and torch's distributed test suite on
both backends (docs/torch_suite.json, written by scripts/run_torch_suite.py). Every number in its
text is computed from those files when it runs; nothing is typed in. This file holds the report's
prose and its order; the analysis (every table, plot and computed sentence) is the package
notebooks/report_analysis, and each code cell is one call into it. Edit those, not the .ipynb.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from notebooks import report_analysis as analysis

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# The analysis is the package notebooks.report_analysis, which imports benchmarks.records: both resolve from the
# repository's root. A kernel started by Jupyter, JupyterLab or VS Code runs in the notebook's own folder,
# execute() runs it at the root, so the first cell looks for the root upwards from wherever it runs.
SETUP = """%matplotlib inline
import sys
from pathlib import Path
ROOT = next(folder for folder in (Path.cwd(), *Path.cwd().parents) if (folder / "notebooks" / "report_analysis").is_dir())
sys.path.insert(0, str(ROOT))
from notebooks import report_analysis as analysis
R = analysis.load_results(analysis.results_folder())"""


def markdown(text: str) -> nbformat.NotebookNode:
    """A cell of prose: the text as written here, without its surrounding blank lines."""
    return nbformat.v4.new_markdown_cell(text.strip())


def call(section, argument: str = "R") -> nbformat.NotebookNode:
    """The code cell that runs one of report_analysis's section functions."""
    return nbformat.v4.new_code_cell(f"analysis.{section.__name__}({argument})")


INTRO = r"""
# ddpkit report

Every figure below is read from `benchmarks/results/*.json` and was measured side by side with the
PyTorch baseline in the same run (candidates interleaved, median of repetitions); the outcomes of
torch's own distributed test suite on both backends come from `docs/torch_suite.json`. `bash
benchmarks/run_all.sh` (about 2 hours on 2 cores) measures all of them again from the checked-out
tree and rebuilds this notebook; `bash benchmarks/run_all.sh --quick` is a smoke run of the same.
Each section names the exact command that produced its file.
"""

ALLREDUCE_INTRO = r"""
## 1. All-reduce

ddpkit's default all-reduce (`ddpkit`: `algorithm="auto"` on ddpkit's default transport, collective checks on) and its
ring over torch.distributed send/recv (`ddpkit_ring_pg`) against `torch.distributed.all_reduce` on gloo (`gloo`),
the memory floor (`floor`: one in-place `a.add_(b)` of the vector in one process), MPICH's `MPI_Allreduce`
(`mpich`) and DeepSpeed's CPU shared-memory all-reduce (`deepspeed`), float32 vectors on one host. A repetition
synchronises the ranks through the candidate itself and times a batch of back-to-back calls; its time is the
slowest rank's; the figure is the median over interleaved repetitions (method: `benchmarks/bench_allreduce.py`).
"""

SYNCBN = r"""
## 2. SyncBatchNorm
"""

DDP = r"""
## 3. DistributedDataParallel
"""

TRAINING = r"""
## 4. Training: ddpkit's pipeline against PyTorch's, like for like
"""

GPU = r"""
## 5. On a GPU: CUDA SyncBatchNorm kernels and DDP

`csrc/syncbn/cuda/` holds ddpkit's own CUDA kernels (Welford statistics, normalize + affine, the
backward sums and element pass; planar and channels-last). With two processes on one GPU the group
is gloo (NCCL refuses two ranks on one device) for both implementations: torch's SyncBatchNorm
gathers the statistics through gloo's staged collectives, ddpkit copies its one buffer per pass to
the host and all-reduces it over shared memory (see "Device tensors on a host group" in
`csrc/comm/engine/engine.h`). At world
size 1 the baseline is torch's CUDA BatchNorm (cuDNN). Times by CUDA events, memory by
`torch.cuda.max_memory_allocated`.
"""

BACKEND = r"""
## 6. The "ddpkit" torch.distributed backend

`dist.init_process_group("ddpkit")` puts torch's own collectives on ddpkit's engine (which calls go
where, op by op, is described at the top of `csrc/backend/backend.h`). Below, in one set of processes: torch.distributed's call on a
gloo group of the same ranks (`gloo`), the same call on the ddpkit group (`backend`), and ddpkit's own
function on that group (`ddpkit`: same engine and segment, so `backend / ddpkit` is the cost of the
backend layer: torch.distributed's Python wrapper, the dispatcher, the Work object). `size` is the
whole vector (all-reduce's tensor, all-gather's output, reduce-scatter's input), float32. Then torch's
own `DistributedDataParallel`, unchanged, on both backends.
"""

MULTIHOST = r"""
## 7. Across hosts

ddpkit's all-reduce and DDP with the ranks on different hosts. The hosts are simulated on this one machine
(`ddpkit.testing.HostPool`): each is a network namespace and a mount namespace with a hostname and a `/dev/shm` of
its own, so ranks on different hosts share no memory and reach each other only over the network, a veth link from
each host to a bridge. The link is left as it is (`unshaped`: as fast as the kernel copies) or limited by tc's token
bucket filter (`tbf`) to 10 Gbit/s (`10gbit`) or 1 Gbit/s (`1gbit`): bandwidth only, no added latency (this kernel
has no netem). `2x2` is 2 hosts × 2 ranks, `2x1` 2 hosts × 1 rank. Every process runs on the same 2 cores (4 of
them at 2x2), so the network costs CPU too: the kernel copies every byte through the veth pair and the bridge on the
cores that run the ranks, where a real network card would take that work off them. Candidates, float32 vectors, all
interleaved in the same repetitions:

| name | what runs |
|---|---|
| `ddpkit` | `ddpkit.all_reduce(t)` on the gloo group (`algorithm="auto"`): ddpkit's hierarchical all-reduce. Up to 64 KiB, the host's all-reduce over its shared memory, then one round across hosts that carries the collective check and the host's result to one rank and the total back; above, the check's round, a reduce-scatter over each host's shared memory, every rank swapping its slice with its counterpart on the other host (both ways at once, each part reduced as it arrives), and an all-gather over shared memory. Everything that crosses hosts goes over TCP connections of ddpkit's own between the ranks, not gloo's. At 2x1 only the steps across hosts run |
| `ddpkit_flat` | `ddpkit.all_reduce(t, algorithm="halving_doubling")`: a ddpkit schedule over gloo's send/recv that ignores the hosts |
| `ddpkit_backend` | `torch.distributed.all_reduce` on a group of the "ddpkit" backend: ddpkit's engine behind torch's own API |
| `gloo` | `torch.distributed.all_reduce` on the gloo group: the baseline |

A repetition synchronises the ranks through the candidate itself, then every rank times a batch of back-to-back
calls of the library's own function (bound once, nothing of the benchmark's between the calls); a point is the
slowest rank's time per call, the median over the repetitions. Every rank also reads its process's CPU time
around the batch, so the table can say how much of the machine's 2 cores a point kept busy. The other collectives
(`broadcast` and `reduce` from the last rank, `all_gather_into_tensor`, `reduce_scatter_tensor`; the size is the
whole tensor: the all-gather's output, the reduce-scatter's input) are timed the same way with the same candidates,
`ddpkit_flat` being ddpkit's collective with `transport="process_group"` (its flat schedule over gloo's send/recv).
`ddpkit` runs them hierarchically too: inside each host over shared memory, and between the two hosts over the same
TCP connections of its own (the broadcast and the reduce as one message from one host to the other, the all-gather
and the reduce-scatter as a swap of blocks, reduced as they arrive).
Then one DDP training step
across 2x2 on the unshaped link (8 linear layers 1024 wide, batch 8 per rank, SGD): ddpkit's DDP (`ddpkit_ddp`),
torch's `DistributedDataParallel` on gloo (`torch_ddp_gloo`) and torch's on the "ddpkit" backend
(`torch_ddp_ddpkit`). The command runs as root, because it makes namespaces:
`sudo .venv/bin/python benchmarks/bench_multihost.py` (`run_all.sh` runs it when it runs as root).
"""

CROSSING = r"""
### 7b. Three hosts and more, and the compressed crossing

From three hosts on, ddpkit's steps across hosts run on a ring over its own connections (reduce-scatter, then
all-gather, each part reduced as it arrives), where they used gloo's all-reduce. Opt-in, the float32 sums and means
that cross hosts travel in bfloat16 (`cross_host_dtype`, `ddpkit.Options`): half the bytes, the steps inside a host
at full precision, every rank with the same bits ([docs/multihost.md](../docs/multihost.md#compressed-crossing-opt-in)).
The all-reduce at 2, 3, 4 and 8 hosts of one rank and 4 hosts of two, unshaped and at 1 Gbit/s, against gloo; `ddpkit_bf16`
is `ddpkit.all_reduce` with the bfloat16 crossing. Then Fashion-MNIST trained across 2 hosts × 2 ranks three ways
with the same seed: float32, bfloat16 across hosts, and torch's `bf16_compress_hook` (bfloat16 everywhere); and
torchft's steady step with one replica group on each of 4 hosts at 1 Gbit/s. Every multi-host figure here comes from
this report's machine: its simulated hosts share its cores.
"""

UNSHAPED = r"""
The unshaped links once more, after two changes that keep the bytes crossing hosts in the cache
([docs/multihost.md](../docs/multihost.md#measured)): the ring's reduce-scatter receives through a window of 1 MiB,
and each of ddpkit's connections asks the kernel for a send buffer of 256 KiB instead of letting it grow to
megabytes, so that a sender stays close behind its receiver. `ddpkit_kernel_buffers` is the same build's all-reduce
on connections that leave their send buffers to the kernel, as gloo's do. The "ddpkit" backend's time is split at
small sizes: `ddpkit_backend_method` is the group's own method without torch.distributed's Python function around
it, and `ddpkit_torch_python` is `ddpkit.all_reduce` after that function's own statements (its checks and options,
without their collective).
"""

DELAYED = r"""
### 7c. Long, fat links

The same all-reduce across links with a round trip of milliseconds, as between regions or clusters: each simulated
host on a subnet of its own behind a router namespace that holds every packet half the round trip
(`ddpkit_tun_delay`, a testing build's program; this kernel has no netem), links shaped with tbf. Each of ddpkit's
connections chooses its send buffer from the path it measures at its set-up: the small buffer that wins on the
unshaped links above only where it holds the path's bandwidth times its round trip, the kernel's own sizing elsewhere
([docs/multihost.md](../docs/multihost.md#wide-area-links)). `ddpkit_send_buffer_256` is the same build with every
connection's buffer fixed at 256 KiB, as before this choice; `ddpkit_kernel_buffers` with every buffer left to the
kernel. The collective check rides in front of the data between two hosts; among more hosts an all-reduce of up
to 16 MiB takes two shots (one exchange with every partner each), and a larger one a ring whose steps stream, each
forwarding the one before it part by part, so that the path's delay is paid about once (docs/multihost.md's wide-area
section). Then the ring at four hosts and 16M floats with more calls, under the hosts' default congestion control
(BBR) and under reno, and torchft's steady step with one replica group on each of 2 hosts across such links.
"""

TORCH_STACK = r"""
## 8. torch's own stack on the ddpkit backend

What torch builds on `torch.distributed`, unchanged, on the "ddpkit" backend against gloo, one host, CPU:

| workload | what runs |
|---|---|
| `fsdp2` | FSDP2: `fully_shard` on each linear layer and on the root, on `DeviceMesh.from_group(group, "cpu")`, AdamW; a model whose gradients dominate the step |
| `ddp_powerSGD` | torch DDP with the `powerSGD_hook` communication hook (low-rank gradient compression, one bucket), SGD |
| `ddp_fp16` | torch DDP with `fp16_compress_hook` (gradients all-reduced as float16), SGD |
| `tp_mlp` | a tensor-parallel MLP (`ColwiseParallel` then `RowwiseParallel`, DTensor), forward and backward; its messages are small |

Both candidates run side by side in the same processes: one copy of the model (same seed, same data) on a group of
each backend, repetitions interleaved; a repetition's figure is the slowest rank's time per step, the figure shown the
median over repetitions. Before timing, the copies take the same warm-up steps and their parameters must agree with
gloo's (`max |param diff|`). For `tp_mlp` a third candidate, `floor`, runs the same model on a mesh of one rank: the
step without any communication, the least any backend could reach. FSDP2's memory: each candidate alone in fresh
processes, the peak resident memory's increase over what the processes held before the model was built, the largest
over ranks. Command: `.venv/bin/python benchmarks/bench_torch_stack.py`.
"""

SHARDING = r"""
## 8b. Sharded data parallelism: ZeRO-1, ZeRO-2 and ZeRO-3

`ddpkit.ShardedOptimizer` on ddpkit's DistributedDataParallel shards AdamW's state (ZeRO-1) and, by default, the
averaged gradients too (ZeRO-2) over the processes: each updates a balanced, contiguous slice of every gradient
bucket, which the reducer reduce-scatters instead of all-reducing, and the parameters are all-gathered after the
step, so a step sends what DDP's does and gives DDP's bits. `ddpkit.FullyShardedDataParallel` (ZeRO-3) shards the
parameters too: each layer is all-gathered before its forward and again before its backward, its gradients
reduce-scattered as its backward ends, in float32 or with bfloat16 compute
([docs/sharding.md](../docs/sharding.md)). Against them: ddpkit's DDP, torch's `ZeroRedundancyOptimizer` on
ddpkit's DDP, torch's FSDP2 on the ddpkit backend and on gloo, and torch's DDP on gloo, each training the same MLP
with AdamW at one thread per process. Targets: at 2 processes and the 25M model, ZeRO-1 ≤ 0.85× and ZeRO-2 ≤ 0.8×
ddpkit DDP's step, ZeRO-1 ≤ 0.9× torch's ZeroRedundancyOptimizer's, ZeRO-3 ≤ 1.0× ddpkit DDP's, ≤ 0.75× FSDP2's
on ddpkit and ≤ 0.45× FSDP2's on gloo; model state within 5% of the ZeRO paper's bytes per parameter; bytes sent
equal to DDP's for ZeRO-1/2, at most 1.5× for ZeRO-3, whose parameter all-gathers carry half the bytes with
bfloat16 compute; ZeRO-3's peak memory ≤ 0.7× DDP's at 2 processes and the 100M model. ZeRO-1/2 come from
`sharding.json`, ZeRO-3 from `sharding_zero3.json` (each with the baselines measured beside it), ZeRO-3's peak
memory from `sharding_memory.json`, measured after ZeRO-3 stopped copying each layer's gradient and the benchmark
stopped keeping DDP's parameters in the processes it measures (in `sharding_zero3.json` they are part of every
peak). Commands:
`.venv/bin/python benchmarks/bench_sharding.py`, with `--candidates` and `--output` as each table's first line says.
"""

FAULT_TOLERANCE = r"""
## 9. Training that survives a lost replica: torchft

torchft (PyTorch's fault-tolerant training: replica groups, a lighthouse that forms a quorum every step, live
recovery of a restarted replica from a healthy one) with its CPU process group, gloo, against
`ddpkit.torchft.ProcessGroupDdpkit`, side by side in one run with the same lighthouse settings, and
`torchrun --max-restarts` with a checkpoint every step as the baseline without torchft. The steady step runs 2
replica groups of one rank; the kill runs 3, one of which is SIGKILLed mid-run and restarted
([docs/fault_tolerance.md](../docs/fault_tolerance.md)). Command: `.venv/bin/python benchmarks/bench_fault_tolerance.py`.
"""

COMMANDS = r"""
## 10. Reproduce

From the repository, after `make main` (which sets up `.venv`):

| what | command |
|---|---|
| everything, then this notebook | `bash benchmarks/run_all.sh` (`--quick` for a smoke run into `benchmarks/results/quick/`) |
| all-reduce grid | `bash benchmarks/peers/install.sh` (MPICH, DeepSpeed; once), then `.venv/bin/python benchmarks/bench_allreduce.py` |
| checked-mode overhead | `.venv/bin/python benchmarks/bench_allreduce.py --check-overhead --world-sizes 2 4 8 --reps 300 --output allreduce_checks` |
| SyncBatchNorm | `.venv/bin/python benchmarks/bench_syncbn.py --device cpu` |
| DDP | `.venv/bin/python benchmarks/bench_ddp.py` |
| the ddpkit torch.distributed backend | `.venv/bin/python benchmarks/bench_backend.py` |
| across simulated hosts (root: the hosts are namespaces) | `sudo .venv/bin/python benchmarks/bench_multihost.py` |
| FSDP2, DDP communication hooks, tensor parallelism on the ddpkit backend | `.venv/bin/python benchmarks/bench_torch_stack.py` |
| ZeRO-1/2/3 against DDP, torch's ZeroRedundancyOptimizer and FSDP2 (root: 2x2 simulated hosts) | `.venv/bin/python benchmarks/bench_sharding.py` (ZeRO-3: `--candidates ddpkit_ddp zero3 zero3_bf16 fsdp2_ddpkit fsdp2_gloo --output sharding_zero3`; its peak memory: `--candidates ddpkit_ddp zero3 zero3_bf16 --models 100M --phases one_host bytes --reps 3 --steps 3 --warmup 1 --output sharding_memory`) |
| torchft on gloo and on ddpkit, the torchrun restart baseline | `.venv/bin/python benchmarks/bench_fault_tolerance.py` |
| torch's distributed test suite on gloo and on ddpkit | `.venv/bin/python scripts/run_torch_suite.py` (writes `docs/torch_suite.json`, `docs/torch_suite.md`) |
| training comparison | `.venv/bin/python benchmarks/bench_training.py --full` (`make main`: the short run) |
| GPU: build, CUDA tests, GPU benchmarks | `bash scripts/gpu_checks.sh build test bench` |
| this notebook only | `.venv/bin/python -m notebooks.report` |
| one training run | `.venv/bin/torchrun --nproc_per_node 2 train.py --dataset fashion_mnist --accumulation-steps 2` |
"""


def build() -> nbformat.NotebookNode:
    cells = [
        markdown(INTRO),
        nbformat.v4.new_code_cell(SETUP),
        call(analysis.provenance),
        markdown("## 0. Infrastructure"),
        call(analysis.infrastructure),
        markdown(ALLREDUCE_INTRO),
        call(analysis.allreduce_time),
        call(analysis.allreduce_targets),
        call(analysis.allreduce_spread),
        call(analysis.allreduce_accuracy),
        call(analysis.allreduce_memory),
        call(analysis.collective_checks),
        call(analysis.latency),
        markdown(SYNCBN),
        call(analysis.syncbn_table),
        call(analysis.syncbn_plot),
        call(analysis.syncbn_local),
        markdown(DDP),
        call(analysis.ddp),
        markdown(TRAINING),
        call(analysis.training),
        markdown(GPU),
        call(analysis.gpu),
        markdown(BACKEND),
        call(analysis.backend),
        markdown(MULTIHOST),
        call(analysis.multihost),
        call(analysis.multihost_targets),
        markdown(CROSSING),
        call(analysis.multihost_hosts),
        markdown(UNSHAPED),
        call(analysis.multihost_unshaped),
        call(analysis.compression),
        call(analysis.fault_tolerance_hosts),
        markdown(DELAYED),
        call(analysis.multihost_delayed),
        call(analysis.multihost_delayed_4x1),
        call(analysis.fault_tolerance_hosts_delayed),
        markdown(TORCH_STACK),
        call(analysis.torch_stack),
        call(analysis.torch_suite, ""),
        markdown(SHARDING),
        call(analysis.sharding),
        markdown(FAULT_TOLERANCE),
        call(analysis.fault_tolerance),
        markdown(COMMANDS),
    ]
    # Ids by position, not nbformat's random ones: a rebuild from the same results is the same file.
    for index, cell in enumerate(cells):
        cell.id = f"cell-{index:02d}"
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return notebook


def execute(
    notebook: nbformat.NotebookNode, results: Path, timeout: int = 300, kernel_folder: Path = REPO
) -> nbformat.NotebookNode:
    """Runs every cell with the kernel in ``kernel_folder`` (the repository's root, or notebooks/ as Jupyter's front
    ends start it); raises on the first failing cell."""
    os.environ["DDPKIT_REPORT_RESULTS"] = str(results.resolve())
    # No timestamps in the cells' metadata: they would change the file at every run.
    NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(kernel_folder)}},
    ).execute()
    return notebook


def write_if_changed(notebook: nbformat.NotebookNode, path: Path) -> bool:
    """Writes ``notebook`` to ``path`` unless the file holds it already; whether it wrote. A tracked
    report rebuilt from the results it shows stays untouched, and the tree clean."""
    text = nbformat.writes(notebook)
    if not text.endswith("\n"):
        text += "\n"  # as nbformat.write ends the file
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--output", type=Path, default=HERE / "report.ipynb")
    parser.add_argument(
        "--execute-only",
        action="store_true",
        help="run the existing notebook at --output instead of rebuilding it (CI)",
    )
    args = parser.parse_args()
    notebook = nbformat.read(args.output, as_version=4) if args.execute_only else build()
    execute(notebook, args.results)
    if write_if_changed(notebook, args.output):
        print(f"wrote {args.output}")
    else:
        print(f"{args.output} is unchanged: the same results give the same report")


if __name__ == "__main__":
    main()
