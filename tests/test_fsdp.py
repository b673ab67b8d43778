"""ddpkit.FullyShardedDataParallel (ZeRO-3) against ddpkit's DistributedDataParallel, bit for bit, on real groups:
world sizes 2 to 8 as subgroups of one pool of 8 ranks (two simulated hosts of two ranks: tests/test_ddp.py, on its
pool of them)."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit

from helpers import caught, run_on_a_fresh_pool

STEPS = 3
FEATURES = 13
# Biases and the norm (at most 62 elements) stay whole; every weight is sharded.
THRESHOLD = 64


class EverythingNet(nn.Module):
    """Units of sizes no world size from 2 to 8 divides but final's (5 divides it), a weight tied between two
    units (owned by the root), a frozen weight and a frozen bias, a norm and biases below the persistence
    threshold."""

    TRAINED_UNITS = (403, 961, 221, 155)  # elements of the sharded units that reduce gradients: embed first

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, 31, bias=False)
        self.hidden = nn.Linear(31, 31)
        self.norm = nn.LayerNorm(31)
        self.frozen = nn.Linear(31, 17)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(17, FEATURES)
        self.head.bias.requires_grad_(False)
        self.reembed = nn.Linear(FEATURES, 31, bias=False)
        self.reembed.weight = self.embed.weight
        self.final = nn.Linear(31, 5)

    def forward(self, x):
        h = self.norm(self.hidden(torch.tanh(self.embed(x))))
        y = self.head(torch.relu(self.frozen(h)))
        return self.final(torch.tanh(self.reembed(y)))


class EvenNet(nn.Module):
    """Units of one weight each, of 208, 256 and 80 elements (2, 4 and 8 ranks divide each): their gradients are
    their reductions' inputs, scaled in place (Note [Gradients of a unit]); the biases stay whole."""

    TRAINED_UNITS = (208, 256, 80)

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, 16)
        self.hidden = nn.Linear(16, 16)
        self.final = nn.Linear(16, 5)

    def forward(self, x):
        return self.final(torch.relu(self.hidden(torch.tanh(self.embed(x)))))


def make_model(net=EverythingNet):
    torch.manual_seed(dist.get_rank())  # rank 0's values win (both wrappers broadcast them)
    return net()


def make_optimizer(named_parameters):
    """Two parameter groups by name: weights with weight decay, the rest without."""
    weights = [p for name, p in named_parameters if name.endswith("weight") and "norm" not in name]
    others = [p for name, p in named_parameters if not (name.endswith("weight") and "norm" not in name)]
    return torch.optim.AdamW(
        [{"params": weights, "weight_decay": 0.1}, {"params": others, "lr": 5e-3, "weight_decay": 0.0}], lr=1e-2
    )


def batch(rank, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, FEATURES, generator=generator), torch.randn(6, 5, generator=generator)


def loss_of(output, target):
    return ((output.float() - target) ** 2).mean()


_GROUPS = {}


def first_ranks(world_size, hosts=None):
    """The group of ranks 0..world_size-1 of the pool (None: the world on one host), made once; ``hosts``: their
    hosts' labels (DDPKIT_TEST_HOSTS, the testing build's split of one machine into hosts, read when the
    group's first collective sets it up). Every rank asks for the same groups in the same order."""
    if world_size == dist.get_world_size() and hosts is None:
        return None
    if (world_size, hosts) not in _GROUPS:
        if hosts is not None:
            os.environ["DDPKIT_TEST_HOSTS"] = ",".join(hosts.split(",") + ["z"] * (dist.get_world_size() - world_size))
        group = dist.new_group(list(range(world_size)))
        if dist.get_rank() < world_size:
            ddpkit.barrier(group)  # sets the group up under the labels
        os.environ.pop("DDPKIT_TEST_HOSTS", None)
        _GROUPS[(world_size, hosts)] = group
    return _GROUPS[(world_size, hosts)]


def names_without_prefix(state):
    return {key.removeprefix("module."): value for key, value in state.items()}


def train(wrap, group, steps=STEPS, micro_batches=1, net=EverythingNet):
    """State dict and optimizer state after ``steps`` AdamW steps of ``wrap(model)``; inside no_sync all but the
    last of ``micro_batches`` backwards."""
    rank = dist.get_rank(group)
    model = wrap(make_model(net))
    named = [(name.removeprefix("module."), p) for name, p in model.named_parameters()]
    optimizer = make_optimizer(named)
    for step in range(steps):
        for micro in range(micro_batches):
            x, y = batch(rank, step * micro_batches + micro)
            synced = micro == micro_batches - 1
            with model.no_sync() if not synced else torch.enable_grad():
                loss_of(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return names_without_prefix(model.state_dict()), model, optimizer


def state_bits(state):
    return {key: value.view(torch.int32) if value.dtype == torch.float32 else value for key, value in state.items()}


def case_matches_ddp(world_size, hosts=None, micro_batches=1, net=EverythingNet):
    """FSDP's and DDP's states after the same training, on the group of the first ``world_size`` ranks."""
    group = first_ranks(world_size, hosts)
    if dist.get_rank() >= world_size:
        return None
    ddp_state, *_ = train(
        lambda m: ddpkit.DistributedDataParallel(m, process_group=group), group, micro_batches=micro_batches, net=net
    )
    fsdp_state, fsdp, _ = train(
        lambda m: ddpkit.FullyShardedDataParallel(m, process_group=group, persistence_threshold=THRESHOLD),
        group,
        micro_batches=micro_batches,
        net=net,
    )
    return state_bits(ddp_state), state_bits(fsdp_state), fsdp.sharding_stats()


def assert_same_bits_as_ddp(results, world_size, exact=True, net=EverythingNet):
    reference = results[0][1]
    for rank, result in enumerate(results[:world_size]):
        ddp_state, fsdp_state, stats = result
        assert fsdp_state.keys() == ddp_state.keys()
        for key in ddp_state:
            assert torch.equal(fsdp_state[key], reference[key]), (world_size, rank, key, "the ranks differ")
            if exact:
                assert torch.equal(fsdp_state[key], ddp_state[key]), (world_size, rank, key)
            else:
                ours, ddps = fsdp_state[key].view(torch.float32), ddp_state[key].view(torch.float32)
                assert (ours - ddps).abs().max() <= 1e-5 * max(1.0, ddps.abs().max()), (world_size, rank, key)
        assert stats["synced_backwards"] == STEPS and stats["gathered_ahead"] > 0, stats
        # A unit of one weight that the world size divides reduces its gradient in place, others copy it
        in_place = sum(size % world_size == 0 for size in net.TRAINED_UNITS)
        assert stats["reduced_in_place"] == in_place * STEPS, stats


def test_matches_ddp_bit_for_bit_at_world_sizes_2_to_8_and_on_two_hosts(pool):
    """Shared memory sums every element in rank order whatever its layout (Note [Reductions] in
    csrc/comm/reduction/reduce_kernel.h), and across two hosts each host's sum first: a reduce-scatter of any
    unit gives the bits of DDP's all-reduce (tests/test_ddp.py checks two hosts of real namespaces too)."""
    for world_size in range(2, 9):
        assert_same_bits_as_ddp(pool(8).run(case_matches_ddp, world_size, timeout=120), world_size)
    assert_same_bits_as_ddp(pool(8).run(case_matches_ddp, 4, "a,a,b,b", timeout=120), 4)


def test_every_rank_has_the_same_bits_across_three_hosts(pool):
    """Across three hosts the ring's order depends on where an element falls (Note [A ring across hosts]), so
    a reduce-scatter and DDP's all-reduce may round an element differently: every rank still ends with the
    same bits, within a few float32 roundings of DDP's (docs/sharding.md states the measured difference)."""
    assert_same_bits_as_ddp(pool(8).run(case_matches_ddp, 3, "a,b,c", timeout=120), 3, exact=False)


def test_no_sync_accumulates_as_ddp_does(pool):
    assert_same_bits_as_ddp(pool(8).run(case_matches_ddp, 3, None, 2, timeout=120), 3)


def test_gradients_reduced_in_place_match_ddp_bit_for_bit(pool):
    """A unit of one weight that the world size divides reduces autograd's gradient itself, scaled in place
    (no input buffer beside it: bench_sharding.py's peak RSS), with DDP's bits, also after no_sync."""
    for world_size, micro_batches in ((2, 1), (4, 2)):
        results = pool(8).run(case_matches_ddp, world_size, None, micro_batches, EvenNet, timeout=120)
        assert_same_bits_as_ddp(results, world_size, net=EvenNet)


# --- compute_dtype against a reference that casts by hand ----------------------------------------


def train_by_hand(group, dtype):
    """compute_dtype's contract by hand: a float32 master, a copy cast to ``dtype`` computes forward and
    backward, its gradients are converted to float32, added to zero and scaled by 1/N as DDP's zeroed buckets
    make them, and summed over the ranks."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    master = make_model()
    ddpkit.ddp.broadcast_tensors(list(master.state_dict().values()), group)
    optimizer = make_optimizer(list(master.named_parameters()))
    scale = torch.scalar_tensor(1.0 / world_size, dtype=torch.float64)
    for step in range(STEPS):
        compute = copy.deepcopy(master).to(dtype)
        x, y = batch(rank, step)
        loss_of(compute(x.to(dtype)), y).backward()
        for p, c in zip(master.parameters(), compute.parameters()):
            if p.requires_grad:
                p.grad = c.grad.float().add_(0.0).mul_(scale)
                ddpkit.all_reduce(p.grad, group=group)
        optimizer.step()
        optimizer.zero_grad()
    return master.state_dict()


def case_compute_dtype(world_size, dtype):
    group = first_ranks(world_size)
    if dist.get_rank() >= world_size:
        return None
    wrap = lambda m: ddpkit.FullyShardedDataParallel(  # noqa: E731
        m, compute_dtype=dtype, process_group=group, persistence_threshold=THRESHOLD
    )
    fsdp_state, *_ = train(wrap, group)
    return state_bits(train_by_hand(group, dtype)), state_bits(fsdp_state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_dtype_matches_casting_by_hand(pool, dtype):
    for world_size in (2, 3):
        for rank, result in enumerate(pool(8).run(case_compute_dtype, world_size, dtype, timeout=120)[:world_size]):
            expected, actual = result
            for key in expected:
                assert torch.equal(actual[key], expected[key]), (world_size, rank, key)


# --- state dicts ----------------------------------------------------------------------------------


def case_checkpoint(world_size, saved):
    """Trains on the first ``world_size`` ranks; returns the full model and optimizer states, and those after
    loading ``saved`` (taken at another world size) into a fresh wrapper and optimizer."""
    group = first_ranks(world_size)
    if dist.get_rank() >= world_size:
        return None
    _, model, optimizer = train(
        lambda m: ddpkit.FullyShardedDataParallel(m, process_group=group, persistence_threshold=THRESHOLD), group
    )
    trained = (model.state_dict(), model.optim_state_dict(optimizer))
    if saved is None:
        return trained
    model.load_state_dict(saved[0])
    model.load_optim_state_dict(optimizer, saved[1])
    return trained, (model.state_dict(), model.optim_state_dict(optimizer))


def assert_same_states(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_states(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_states(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


def test_full_state_dicts_load_at_another_world_size(pool):
    saved = pool(8).run(case_checkpoint, 4, None, timeout=120)[0]
    model_state, optim_state = saved
    assert tuple(model_state["hidden.weight"].shape) == (31, 31) and "reembed.weight" in model_state
    assert tuple(optim_state["state"]["hidden.weight"]["exp_avg"].shape) == (31, 31)
    for result in pool(8).run(case_checkpoint, 3, saved, timeout=120)[:3]:
        _, loaded = result
        assert_same_states(loaded, saved)


def case_snapshots():
    """Full state dicts taken after a step, then after two more steps, one of them after loading the optimizer's
    dict back (Note [Full state dicts are snapshots])."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(FEATURES, 31), nn.BatchNorm1d(31), nn.Tanh(), nn.Linear(31, 5))
    model = ddpkit.FullyShardedDataParallel(module, persistence_threshold=THRESHOLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(index):
        x, y = batch(dist.get_rank(), index)
        loss_of(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)
    taken = (model.state_dict(), model.optim_state_dict(optimizer))
    copies = copy.deepcopy(taken)
    step(1)
    model.load_optim_state_dict(optimizer, taken[1])
    step(2)
    return taken, copies


def test_full_state_dicts_are_snapshots_that_training_on_leaves_alone(pool):
    """The persistent parameters' moments, every "step" and the buffers included: once they were the live
    tensors, and a resumed train.py --shard parameters run read after training on seemed to have loaded others."""
    for taken, copies in pool(2).run(case_snapshots, timeout=60):
        assert "0.bias" in taken[1]["state"] and "1.running_mean" in taken[0]  # persistent, and a buffer
        assert_same_states(taken, copies)


# --- errors and lifetimes -------------------------------------------------------------------------


def case_mismatched_model():
    torch.manual_seed(0)
    model = EverythingNet() if dist.get_rank() == 0 else nn.Sequential(nn.Linear(FEATURES, 32))
    return caught(ddpkit.FullyShardedDataParallel, model)


def test_a_model_that_differs_across_ranks_is_refused_on_every_rank(pool):
    for error in pool(2).run(case_mismatched_model):
        assert error is not None and "FullyShardedDataParallel: rank 1 has" in error, error


def case_non_elementwise_optimizer():
    """LBFGS and Adafactor built on the wrapper's pieces: refused at their first step, before it changes anything;
    AdamW then steps."""
    model = ddpkit.FullyShardedDataParallel(make_model(), persistence_threshold=THRESHOLD)
    x, y = batch(dist.get_rank(), 0)
    before = model.state_dict()
    errors = []
    for optimizer_class in (torch.optim.LBFGS, torch.optim.Adafactor):
        optimizer = optimizer_class(model.parameters())

        def closure():
            optimizer.zero_grad()
            loss = loss_of(model(x), y)
            loss.backward()
            return loss

        errors.append(caught(optimizer.step, closure))
    unchanged = all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    adamw = torch.optim.AdamW(model.parameters())
    loss_of(model(x), y).backward()
    return errors, unchanged, caught(adamw.step)


def test_a_non_elementwise_optimizer_is_refused_on_every_rank_at_its_first_step(pool):
    for errors, unchanged, adamw in pool(2).run(case_non_elementwise_optimizer, timeout=60):
        for error, name in zip(errors, ("LBFGS", "Adafactor")):
            assert error is not None and "FullyShardedDataParallel: torch.optim" in error, error
            assert f"{name} does not update each element on its own" in error, error
        assert unchanged and adamw is None


def case_buffers_released():
    """Where the compute buffers stand after a training step and after an evaluation forward."""
    model = ddpkit.FullyShardedDataParallel(make_model(), persistence_threshold=THRESHOLD)
    sharded = [p for u in model._units if u.index is not None for p in u.compute[0].values() if p.numel() > THRESHOLD]
    x, y = batch(dist.get_rank(), 0)
    loss_of(model(x), y).backward()
    after_backward = [p.untyped_storage().nbytes() for p in sharded]
    with torch.no_grad():
        model(x)
    after_eval = [p.untyped_storage().nbytes() for p in sharded]
    shards = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return after_backward, after_eval, shards, model.sharding_stats()


def test_gathered_units_are_released_after_backward_and_after_an_evaluation_forward(pool):
    for rank, (after_backward, after_eval, shards, stats) in enumerate(pool(2).run(case_buffers_released)):
        assert set(after_backward) == {0} and set(after_eval) == {0}, (after_backward, after_eval)
        # 31x31 = 961 elements over two ranks: 481 on rank 0, 480 on rank 1; the norm stays whole.
        assert shards["module.hidden.weight"] == ((481,) if rank == 0 else (480,)), shards
        assert shards["module.norm.weight"] == (31,)
        assert stats["peak_gathered_units"] <= 3, stats


def case_dcp(world_size, path, save):
    """Saves (``save``) or loads a torch.distributed.checkpoint of the model and optimizer through the sharded
    state dicts on the first ``world_size`` ranks; returns the full states after it."""
    import torch.distributed.checkpoint as dcp

    group = first_ranks(world_size)
    if dist.get_rank() >= world_size:
        return None
    wrap = lambda m: ddpkit.FullyShardedDataParallel(  # noqa: E731
        m, process_group=group, persistence_threshold=THRESHOLD
    )
    _, model, optimizer = train(wrap, group, steps=1 if save else 0)
    sharded = {"model": model.sharded_state_dict(), "optim": model.sharded_optim_state_dict(optimizer)}
    if save:
        dcp.save(sharded, checkpoint_id=path, process_group=group)
    else:
        dcp.load(sharded, checkpoint_id=path, process_group=group)
        model.load_sharded_optim_state_dict(optimizer, sharded["optim"])
    return model.state_dict(), model.optim_state_dict(optimizer)


def test_sharded_state_dicts_checkpoint_through_dcp_at_another_world_size(pool, tmp_path):
    saved = pool(8).run(case_dcp, 4, str(tmp_path), True, timeout=120)[0]
    for loaded in pool(8).run(case_dcp, 3, str(tmp_path), False, timeout=120)[:3]:
        assert_same_states(loaded, saved)


def case_cross_host_wire():
    """The wire format FSDP's reductions cross hosts with: the group's ddpkit.Options, or the argument's."""
    compressing = dist.new_group(backend="ddpkit", pg_options=ddpkit.Options(cross_host_dtype=torch.bfloat16))
    wrap = ddpkit.FullyShardedDataParallel
    return [
        wrap(make_model(), process_group=compressing).cross_host_wire,
        wrap(make_model()).cross_host_wire,
        wrap(make_model(), cross_host_dtype=torch.float16).cross_host_wire,
    ]


def test_reductions_cross_hosts_as_the_group_asks(pool):
    assert pool(2).run(case_cross_host_wire, timeout=60) == [["bfloat16", "exact", "float16"]] * 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(FEATURES, 40)
        self.norm = nn.LayerNorm(40)
        self.down = nn.Linear(40, FEATURES)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


class CheckpointedBlocks(nn.Module):
    """Two blocks run under activation checkpointing (their forward runs again inside backward)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(FEATURES, 5)

    def forward(self, x, fail=False):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            if fail:
                raise ValueError("a forward that raised")
        return self.head(x)


def case_blocks_as_ddp():
    """Units of a class (each Block), under activation checkpointing, after a forward that raised: DDP's bits."""
    rank = dist.get_rank()
    states = []
    for fully_sharded in (False, True):
        torch.manual_seed(rank)
        if fully_sharded:
            model = ddpkit.FullyShardedDataParallel(CheckpointedBlocks(), units={Block}, persistence_threshold=40)
            assert len(model._units) == 3, [type(u.module).__name__ for u in model._units]
            assert caught(model, batch(rank, 0)[0], fail=True) == "ValueError: a forward that raised"
            assert all(p.dim() == 1 for _, p in model.named_parameters()), "masters registered again"
        else:
            model = ddpkit.DistributedDataParallel(CheckpointedBlocks())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        for step in range(2):
            x, y = batch(rank, step)
            loss_of(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(state_bits(names_without_prefix(model.state_dict())))
    return all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_units_of_a_class_under_activation_checkpointing_after_a_forward_that_raised(pool):
    assert pool(2).run(case_blocks_as_ddp, timeout=60) == [True, True]


def case_another_unit_on_one_rank():
    """Rank 1 runs the model without its hidden layer: the gathers no longer pair up."""
    model = ddpkit.FullyShardedDataParallel(make_model(), persistence_threshold=THRESHOLD)
    if dist.get_rank() == 1:
        model.module.hidden = nn.Identity()
    x, y = batch(dist.get_rank(), 0)
    return caught(lambda: loss_of(model(x), y).backward())


def test_a_forward_that_runs_other_units_on_one_rank_raises_on_every_rank():
    for error in run_on_a_fresh_pool(case_another_unit_on_one_rank):
        assert error is not None and "FullyShardedDataParallel: the" in error, error
        assert "every rank must run the same units in the same order" in error, error


def case_clipped_as_ddp():
    """A step after clip_grad_norm_, against DDP's with torch.nn.utils.clip_grad_norm_: the norm and the
    parameters, within float32 roundings (the norms add up in another order)."""
    rank = dist.get_rank()
    out = []
    for fully_sharded in (False, True):
        torch.manual_seed(rank)
        model = (
            ddpkit.FullyShardedDataParallel(EverythingNet(), persistence_threshold=THRESHOLD)
            if fully_sharded
            else ddpkit.DistributedDataParallel(EverythingNet())
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = batch(rank, 0)
        loss_of(model(x), y).backward()
        norm = (
            model.clip_grad_norm_(0.05) if fully_sharded else torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        )
        optimizer.step()
        out.append((float(norm), names_without_prefix(model.state_dict())))
    return out


def test_clip_grad_norm_clips_by_the_norm_over_every_rank(pool):
    for (ddp_norm, ddp_state), (norm, state) in pool(2).run(case_clipped_as_ddp, timeout=60):
        assert norm == pytest.approx(ddp_norm, rel=1e-5) and norm > 0.05
        for key, value in ddp_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7)
