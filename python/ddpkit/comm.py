"""Collectives built from point-to-point messages, as thin wrappers over ``torch.ops.ddpkit``.

Every function works in place (or returns a new tensor for ``gather``), takes the process group as
``group`` (``None``: the default group) and runs the C++ algorithm of ``csrc/comm/collectives/collectives.h``
with the GIL released, through the group's engine (Note [Collective engine], csrc/comm/engine/engine.h).
See Note [All-reduce algorithms] there for what each ``algorithm`` does.

``transport`` picks how the bytes move: ``"auto"`` (default) uses shared memory when every rank of
the group runs on this host and the tensor is on CPU, else the group's own send/recv;
``"shm"`` and ``"process_group"`` force one. The environment variable ``DDPKIT_TRANSPORT=shm|
process_group`` forces one for every ``"auto"`` call of the program (set it alike on every rank,
before the program's first collective, which reads it once).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C  # registers torch.ops.ddpkit.*; all_reduce_eager
from ._on_import import when_imported

# The names the C++ side accepts, read from its enums' name tables (one source for each contract).
ALGORITHMS = tuple(torch.ops.ddpkit.algorithms())
# Those a group on one host runs ("hierarchical" needs a group spanning hosts).
ONE_HOST_ALGORITHMS = tuple(a for a in ALGORITHMS if a != "hierarchical")
TRANSPORTS = tuple(torch.ops.ddpkit.transports())
REDUCE_OPS = tuple(torch.ops.ddpkit.reduce_ops())
WIRE_FORMATS = tuple(torch.ops.ddpkit.wire_formats())

_DISTRIBUTED_AVAILABLE = dist.is_available()
# torch's registry of groups, whose default group ``dist.group.WORLD`` reads through two properties.
_WORLD = getattr(dist.distributed_c10d, "_world", None) if _DISTRIBUTED_AVAILABLE else None
if not hasattr(_WORLD, "_default_pg"):
    _WORLD = None
_TORCH_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def group_name(group: dist.ProcessGroup | None = None) -> str:
    """The registered name of ``group`` (default: the world group), which the C++ ops resolve."""
    # On every collective's path: one attribute read when the group is given; for the default group
    # the name is kept while that group is the default one (a weak reference: a destroyed group is
    # not kept alive, and a new default group is told apart).
    global _default_group, _default_group_name
    if group is not None:
        try:
            return group.group_name
        except AttributeError:
            raise ValueError(_not_a_group(group)) from None
    if _WORLD is not None:
        world = _WORLD._default_pg
    else:
        world = dist.group.WORLD if _DISTRIBUTED_AVAILABLE else None
    if world is None:
        raise RuntimeError(
            "ddpkit: torch.distributed is not initialized; call ddpkit.init_distributed() "
            "(or torch.distributed.init_process_group) first"
        )
    if _default_group() is not world:
        _default_group_name = world.group_name
        _default_group = weakref.ref(world)
    return _default_group_name


# The default group whose name group_name() keeps, and that name.
def _no_default_group() -> dist.ProcessGroup | None:
    return None


_default_group: Callable[[], dist.ProcessGroup | None] = _no_default_group
_default_group_name = ""


def _not_a_group(group: object) -> str:
    if _DISTRIBUTED_AVAILABLE and group is dist.GroupMember.NON_GROUP_MEMBER:
        return (
            "ddpkit: this rank is not a member of the group (torch.distributed.new_group returns "
            "GroupMember.NON_GROUP_MEMBER to the ranks it leaves out); call collectives of a group only "
            "on its members"
        )
    return f"ddpkit: group must be a torch.distributed ProcessGroup or None, got {group!r}"


def _op_name(op: str | dist.ReduceOp) -> str:
    # An op ddpkit does not reduce is passed on by name: the C++ side rejects it inside the
    # collective, so that every rank raises (Note [Collective checks]).
    if isinstance(op, str):
        return op
    try:
        return _TORCH_OPS[op]
    except (KeyError, TypeError):
        return str(op).rsplit(".", 1)[-1].lower()  # RedOpType.PRODUCT -> "product"


# The wire formats of Note [Compressed crossing] (csrc/comm/core/wire_format.h) by the dtype that names them.
_WIRE_FORMATS = {None: "exact", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def wire_format(cross_host_dtype: torch.dtype | None) -> str:
    """The name of the wire format that carries a float32 sum or mean across hosts in
    ``cross_host_dtype`` (None: exact, the default); raises ValueError for any other dtype."""
    try:
        return _WIRE_FORMATS[cross_host_dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"ddpkit: cross_host_dtype must be None, torch.bfloat16 or torch.float16, got {cross_host_dtype!r}"
        ) from None


def all_reduce(
    tensor: Tensor,
    op: str | dist.ReduceOp = "sum",
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    transport: str = "auto",
    cross_host_dtype: torch.dtype | None = None,
) -> Tensor:
    """Reduces ``tensor`` across all ranks in place; every rank ends with the same bits.

    ``cross_host_dtype`` (torch.bfloat16 or torch.float16) sends a float32 sum or mean across hosts in
    that dtype, half the bytes, while the steps inside a host keep full precision (Note [Compressed
    crossing] in csrc/comm/core/wire_format.h: what is rounded where); every rank must pass the same."""
    op, name = _op_name(op), group_name(group)
    wire = "exact" if cross_host_dtype is None else wire_format(cross_host_dtype)  # the common case, no call
    # Eager calls skip the dispatcher where it would do nothing (Note [Eager calls past the
    # dispatcher]); torch.compile traces _all_reduce_in_graph in the binding's place (Note
    # [Collectives under torch.compile]).
    if not _all_reduce_eager(tensor, op, algorithm, name, transport, wire):
        torch.ops.ddpkit.all_reduce_.default(tensor, op, algorithm, name, transport, wire)
    return tensor


_all_reduce_eager = _C.all_reduce_eager


# Note [Collectives under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The collective ops work in place and return their argument (-> Tensor(a!)), which AOTAutograd
# cannot functionalize (tests/test_opcheck.py keeps that as an expected failure), so a compiled
# function calling one would fail to compile, and an op without outputs (barrier) could be dropped
# from a graph. The functions below therefore run their op eagerly under torch.compile, with a graph
# break at the call, as SyncBatchNorm does (Note [SyncBatchNorm under torch.compile]): the code
# before and after the collective is compiled, and the collective runs where every rank expects
# it. all_reduce pays nothing for this in eager code: Dynamo traces _all_reduce_in_graph in the
# binding's place; the others check torch.compiler.is_compiling().
#
# Note [Compile support waits for Dynamo]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Importing torch._dynamo, which substitute_in_graph and torch.compiler.disable need, costs about as
# much as importing torch, and most processes that import ddpkit never compile (benchmark ranks,
# launchers, short jobs). So the compile support above registers itself when Dynamo is imported
# (_on_import.when_imported), which torch.compile always does before it traces anything.
# tests/test_packaging.py checks that importing ddpkit leaves Dynamo unimported; the compile tests of
# tests/test_opcheck.py check that the registration still happens in time.
_DYNAMO = "torch._dynamo"


def _eagerly_under_compile(function: Callable) -> Callable:
    eagerly = None  # torch.compiler.disable(function), once Dynamo is imported (is_compiling() implies it)

    def disable(dynamo) -> None:
        nonlocal eagerly
        eagerly = torch.compiler.disable(function)

    when_imported(_DYNAMO, disable)

    @functools.wraps(function)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return eagerly(*args, **kwargs)
        return function(*args, **kwargs)

    return call


def _all_reduce_op(tensor: Tensor, op: str, algorithm: str, group_name: str, transport: str, wire: str) -> None:
    torch.ops.ddpkit.all_reduce_.default(tensor, op, algorithm, group_name, transport, wire)


def _all_reduce_in_graph(tensor: Tensor, op: str, algorithm: str, group_name: str, transport: str, wire: str) -> bool:
    """What torch.compile traces where eager code calls the binding: the op, run eagerly."""
    _all_reduce_op(tensor, op, algorithm, group_name, transport, wire)
    return True


def _register_all_reduce(dynamo) -> None:
    global _all_reduce_op
    _all_reduce_op = torch.compiler.disable(_all_reduce_op)
    dynamo.substitute_in_graph(_C.all_reduce_eager, skip_signature_check=True)(_all_reduce_in_graph)


when_imported(_DYNAMO, _register_all_reduce)


@_eagerly_under_compile
def broadcast(tensor: Tensor, src: int = 0, group: dist.ProcessGroup | None = None, transport: str = "auto") -> Tensor:
    """Copies rank ``src``'s ``tensor`` into ``tensor`` on every rank (binomial tree)."""
    return torch.ops.ddpkit.broadcast_.default(tensor, src, group_name(group), transport)


@_eagerly_under_compile
def reduce(
    tensor: Tensor,
    dst: int = 0,
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None,
    transport: str = "auto",
) -> Tensor:
    """Leaves the reduction in rank ``dst``'s ``tensor``; other ranks' tensors hold partial results."""
    return torch.ops.ddpkit.reduce_.default(tensor, dst, _op_name(op), group_name(group), transport)


@_eagerly_under_compile
def gather(
    tensor: Tensor, dst: int = 0, group: dist.ProcessGroup | None = None, transport: str = "auto"
) -> Tensor | None:
    """On rank ``dst``: a ``[world_size, *tensor.shape]`` tensor of every rank's ``tensor``; elsewhere None."""
    name = group_name(group)
    gathered = torch.ops.ddpkit.gather.default(tensor, dst, name, transport)
    return gathered if dist.get_rank(group) == dst else None


@_eagerly_under_compile
def scatter(
    output: Tensor,
    chunks: Tensor | None = None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    transport: str = "auto",
) -> Tensor:
    """Writes row ``i`` of rank ``src``'s ``chunks`` (shape ``[world_size, *output.shape]``) into rank i's ``output``."""
    return torch.ops.ddpkit.scatter_.default(output, chunks, src, group_name(group), transport)


@_eagerly_under_compile
def all_gather_single(
    output: Tensor,
    input: Tensor,
    group: dist.ProcessGroup | None = None,
    algorithm: str = "auto",
    transport: str = "auto",
) -> Tensor:
    """Writes rank i's ``input`` into block i of ``output`` (``world_size * input.numel()`` elements) everywhere."""
    return torch.ops.ddpkit.all_gather_into_tensor_.default(output, input, algorithm, group_name(group), transport)


@_eagerly_under_compile
def reduce_scatter_single(
    output: Tensor,
    input: Tensor,
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None,
    algorithm: str = "auto",
    transport: str = "auto",
    cross_host_dtype: torch.dtype | None = None,
) -> Tensor:
    """Writes the reduction over ranks of block ``rank`` of ``input`` into ``output``; ``input`` is unchanged.
    ``cross_host_dtype`` as all_reduce's."""
    return torch.ops.ddpkit.reduce_scatter_tensor_.default(
        output, input, _op_name(op), algorithm, group_name(group), transport, wire_format(cross_host_dtype)
    )


# torch 2.13 renamed torch.distributed's all_gather_into_tensor and reduce_scatter_tensor to these names and
# deprecated the old ones; ddpkit's old names stay, as aliases.
all_gather_into_tensor = all_gather_single
reduce_scatter_tensor = reduce_scatter_single


@_eagerly_under_compile
def barrier(group: dist.ProcessGroup | None = None, transport: str = "auto") -> None:
    """Returns when every rank of ``group`` has called it."""
    torch.ops.ddpkit.barrier.default(group_name(group), transport)


def resolved_transport(group: dist.ProcessGroup | None = None, transport: str = "auto") -> str:
    """What ``transport`` means for CPU tensors of ``group``: ``"shm"`` or ``"process_group"``.

    Collective: every rank of the group must call it at the same point.
    """
    return torch.ops.ddpkit.resolved_transport(group_name(group), transport)


class Topology(NamedTuple):
    """Which ranks of a group share a host: ``hosts[h]`` lists host h's ranks (hosts numbered by their
    lowest rank); ``local_rank`` is this rank's index among its host's ranks, ``local_size`` their number."""

    hosts: tuple
    local_rank: int
    local_size: int


def topology(group: dist.ProcessGroup | None = None) -> Topology:
    """The hosts of ``group`` as its ranks see them (Note [Topology], csrc/comm/topology/topology.h): learnt
    from each rank's host identity over the group's own messages, so subgroups and meshes get their own.

    Collective: every rank of the group must call it at the same point.
    """
    host_of = torch.ops.ddpkit.topology(group_name(group))
    hosts = tuple(tuple(r for r, h in enumerate(host_of) if h == host) for host in range(max(host_of) + 1))
    rank = dist.get_rank(group)
    mine = hosts[host_of[rank]]
    return Topology(hosts, mine.index(rank), len(mine))


def set_collective_checks(enabled: bool) -> None:
    """Turns the header exchange that detects mismatched collectives on or off (on by default).

    All ranks must use the same setting. See Note [Collective checks] in csrc/comm/core/communicator.h.
    """
    torch.ops.ddpkit.set_collective_checks(enabled)


def collective_checks_enabled() -> bool:
    return torch.ops.ddpkit.collective_checks_enabled()


def comm_counters() -> dict:
    """What this process's ddpkit collectives did since the last reset; and under "links", what every
    live link across hosts of this process chose for its send buffer and why (Note [Send buffers] in
    csrc/comm/links/send_buffers.h), which a reset leaves alone: one dict per link, in the order the
    links were made, with the group's ``peer`` rank at its other end, the ``round_trip_us`` TCP had
    measured at its set-up, the ``interface_bits_per_s`` it leaves by (or the rate assumed where the
    interface tells none), the ``choice`` ("short path", "long path", "grown" or
    "DDPKIT_LINK_SEND_BUFFER"), the ``requested_bytes`` it asked for (0: the kernel's sizing), the
    ``send_buffer_bytes`` the kernel books now, and how many times it has ``grown``."""
    collectives, messages, nbytes, peak_buffered = torch.ops.ddpkit.comm_counters()
    return {
        "collectives": collectives,
        "messages_sent": messages,
        "bytes_sent": nbytes,
        "peak_buffered_bytes": peak_buffered,
        "links": _link_paths(),
    }


def _link_paths() -> list[dict]:
    flat, choices = torch.ops.ddpkit.link_paths(), torch.ops.ddpkit.send_buffer_choices()
    fields = ("peer", "round_trip_us", "interface_bits_per_s", "requested_bytes", "send_buffer_bytes", "grown")
    links = []
    for at in range(0, len(flat), len(fields) + 1):
        link = dict(zip(fields, flat[at : at + len(fields)]))
        link["choice"] = choices[flat[at + len(fields)]]
        links.append(link)
    return links


def choose_send_buffer(round_trip_us: int, bits_per_s: int) -> str:
    """What a link across hosts chooses at its set-up for a path of ``round_trip_us`` across an
    interface of ``bits_per_s``: "short path" (the small send buffer holds rate x round trip) or "long
    path" (the kernel sizes it); Note [Send buffers]."""
    return torch.ops.ddpkit.choose_send_buffer(round_trip_us, bits_per_s)


def reset_comm_counters() -> None:
    torch.ops.ddpkit.reset_comm_counters()


def choose_algorithm(
    nbytes: int, world_size: int, shared_memory: bool = False, hierarchical: bool = False, op: str = "sum"
) -> str:
    """The algorithm ``algorithm="auto"`` runs for a CPU message of ``nbytes`` on ``world_size`` ranks, over
    shared memory or not, in a group spanning hosts or not (Note [Choosing an algorithm])."""
    return torch.ops.ddpkit.choose_algorithm(nbytes, world_size, shared_memory, hierarchical, op)


# Fake kernels: what each collective returns, from shapes and the group's size alone, so that
# torch.compile, torch.export and torch.library.opcheck can trace calls to them (FakeTensors:
# nothing communicates). They are also the ops' Meta kernels: real meta tensors still take part in
# the group's collective check (ddpkit::meta_collective, no data), so that a meta tensor on one rank
# raises on every rank instead of skipping the collective there. The in-place ops return their
# (mutated) argument, as their schemas say.
def _meta_check(
    collective: str, tensor: Tensor, op: str, algorithm: str, root: int, group_name: str, transport: str
) -> None:
    from torch._subclasses.fake_tensor import (
        FakeTensor,  # only where something traces (Note [Compile support waits for Dynamo])
    )

    if not isinstance(tensor, FakeTensor):
        torch.ops.ddpkit.meta_collective.default(collective, tensor, op, algorithm, root, group_name, transport)


@torch.library.register_fake("ddpkit::all_reduce_")
def _all_reduce_fake(tensor: Tensor, op: str, algorithm: str, group_name: str, transport: str = "auto") -> Tensor:
    _meta_check("all_reduce", tensor, op, algorithm, -1, group_name, transport)
    return tensor


@torch.library.register_fake("ddpkit::broadcast_")
def _broadcast_fake(tensor: Tensor, src: int, group_name: str, transport: str = "auto") -> Tensor:
    _meta_check("broadcast", tensor, "", "", src, group_name, transport)
    return tensor


@torch.library.register_fake("ddpkit::reduce_")
def _reduce_fake(tensor: Tensor, dst: int, op: str, group_name: str, transport: str = "auto") -> Tensor:
    _meta_check("reduce", tensor, op, "", dst, group_name, transport)
    return tensor


@torch.library.register_fake("ddpkit::scatter_")
def _scatter_fake(output: Tensor, chunks: Tensor | None, src: int, group_name: str, transport: str = "auto") -> Tensor:
    _meta_check("scatter", output, "", "", src, group_name, transport)
    return output


@torch.library.register_fake("ddpkit::all_gather_into_tensor_")
def _all_gather_fake(output: Tensor, input: Tensor, algorithm: str, group_name: str, transport: str = "auto") -> Tensor:
    _meta_check("all_gather_into_tensor", input, "", algorithm, -1, group_name, transport)
    return output


@torch.library.register_fake("ddpkit::reduce_scatter_tensor_")
def _reduce_scatter_fake(
    output: Tensor, input: Tensor, op: str, algorithm: str, group_name: str, transport: str = "auto"
) -> Tensor:
    _meta_check("reduce_scatter_tensor", output, op, algorithm, -1, group_name, transport)
    return output


@torch.library.register_fake("ddpkit::gather")
def _gather_fake(tensor: Tensor, dst: int, group_name: str, transport: str = "auto") -> Tensor:
    _meta_check("gather", tensor, "", "", dst, group_name, transport)
    group = dist.distributed_c10d._resolve_process_group(group_name)
    shape = (group.size(), *tensor.shape) if group.rank() == dst else (0,)
    return tensor.new_empty(shape)
