"""ddpkit.ShardedOptimizer (ZeRO-1 and ZeRO-2) against a plain optimizer and against ddpkit's DDP, on real
groups: the same bits on every rank, at world sizes 2-8 and across hosts (subgroups of one pool, split into
hosts by the testing build's DDPKIT_TEST_HOSTS; tests/test_ddp.py checks two hosts of real namespaces, in
its pool of them)."""

import os

import torch
import torch.distributed as dist
from torch import nn

import ddpkit

from helpers import bits, caught

FEATURES = 13  # odd sizes: parameter counts not divisible by the world size
STEPS = 4
BUCKET_MB = 0.0004  # several buckets even for these small models


class Tied(nn.Module):
    """Tied weights (the embedding used again as the unembedding), a frozen bias, a fixed parameter."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, FEATURES, bias=False)
        self.hidden = nn.Linear(FEATURES, FEATURES)
        self.unembed = nn.Linear(FEATURES, FEATURES, bias=False)
        self.unembed.weight = self.embed.weight
        self.head = nn.Linear(FEATURES, 3)
        self.scale = nn.Parameter(torch.tensor(0.5), requires_grad=False)  # fixed, never trained
        self.hidden.bias.requires_grad_(False)  # frozen

    def forward(self, x):
        return self.head(self.unembed(torch.tanh(self.hidden(self.embed(x)))) * self.scale)


def make_model(seed=0):
    torch.manual_seed(seed)
    return Tied()


def param_groups(model):
    """Two groups with their own hyperparameters: the weights decay, the rest do not."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]


def batch(step, rank=None, world_size=1, size=12):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(size, FEATURES, generator=generator)
    y = torch.randn(size, 3, generator=generator)
    if rank is None:
        return x, y
    per = size // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(model, optimizer, steps, rank=None, world_size=1, scheduler=None):
    for step in range(steps):
        x, y = batch(step, rank, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- cases run on every rank -----------------------------------------------------------------------


def case_alone_equals_a_plain_optimizer(steps):
    """ZeRO-1 with no DDP: every rank sees the whole batch, so no averaging is needed; 10 AdamW steps with
    param groups, tied, frozen and fixed parameters and an LR scheduler equal a plain AdamW's bits."""
    reference = make_model()
    plain = torch.optim.AdamW(param_groups(reference), lr=0.01)
    expected = train(reference, plain, steps, scheduler=torch.optim.lr_scheduler.StepLR(plain, 3, 0.5))
    model = make_model()
    sharded = ddpkit.ShardedOptimizer(param_groups(model), torch.optim.AdamW, lr=0.01)
    got = train(model, sharded, steps, scheduler=torch.optim.lr_scheduler.StepLR(sharded, 3, 0.5))
    same = all(torch.equal(bits(expected[k]), bits(got[k])) for k in expected)
    state = sharded.state_dict()
    plain_state = plain.state_dict()
    same_state = state["param_groups"] == plain_state["param_groups"] and all(
        all(torch.equal(state["state"][i][key], value) for key, value in entries.items())
        for i, entries in plain_state["state"].items()
    )
    same_keys = sorted(state["state"]) == sorted(plain_state["state"])
    return same, same_state, same_keys, [g["lr"] for g in sharded.param_groups]


def build(model, group, stage):
    """``stage``: "ddp" (ddpkit DDP + AdamW, the reference), "zero1" or "zero2" (DDP + ShardedOptimizer; ZeRO-2
    lets its parameters' all-gathers run into the next forward, which train() reads them through)."""
    ddp = ddpkit.DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=BUCKET_MB, first_bucket_cap_mb=BUCKET_MB
    )
    if stage == "ddp":
        return ddp, torch.optim.AdamW(param_groups(ddp), lr=0.01)
    zero2 = stage == "zero2"
    return ddp, ddpkit.ShardedOptimizer(
        param_groups(ddp), torch.optim.AdamW, shard_gradients=zero2, overlap_gather=zero2, lr=0.01
    )


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def case_zero_and_ddp(groups, steps):
    """ddpkit DDP + AdamW, ZeRO-1 and ZeRO-2 on subgroups: for each (ranks, host labels) of ``groups``, the
    first ``ranks`` ranks, split into hosts by the labels (DDPKIT_TEST_HOSTS, the testing build's split of
    one machine; None: one host). Returns each group's trained states (compared by the test) on its ranks."""
    rank = dist.get_rank()
    out = {}
    for n, labels in groups:
        if labels is not None:
            os.environ["DDPKIT_TEST_HOSTS"] = ",".join(labels.split(",") + ["z"] * (dist.get_world_size() - n))
        group = dist.new_group(list(range(n)))
        if rank < n:
            states = {}
            for stage in ("ddp", "zero1", "zero2"):
                ddp, optimizer = build(make_model(), group, stage)
                states[stage] = train(ddp, optimizer, steps, rank, n)
            out[(n, labels)] = states, ddp.reducer_stats()["buckets"], ddpkit.comm.topology(group)
        os.environ.pop("DDPKIT_TEST_HOSTS", None)
    return out


def same_bits(a, b):
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def case_rules_as_ddp(steps):
    """Accumulation under no_sync(), a parameter unused on one rank, one frozen after wrapping, a step after
    zero_grad() with no backward: ZeRO-1 and -2 keep DDP's bits through all of them."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    states = {}
    for stage in ("ddp", "zero1", "zero2"):
        model = make_model()
        model.extra = nn.Linear(FEATURES, 3)  # used on rank 0 only
        ddp, optimizer = build(model, None, stage)
        accumulate = ddpkit.GradientAccumulation(ddp, 2)
        for step in range(steps):
            if step == 2:
                model.head.weight.requires_grad_(False)  # frozen after wrapping
            for micro in range(2):
                x, y = batch(10 * step + micro, rank, world_size)
                out = ddp(x)
                if rank == 0:
                    out = out + model.extra(x)
                accumulate.backward(nn.functional.mse_loss(out, y))
            optimizer.step()
            optimizer.zero_grad()
        optimizer.step()  # no backward since zero_grad(): nothing moves
        states[stage] = state_of(model)
    return [stage for stage in ("zero1", "zero2") if not same_bits(states["ddp"], states[stage])]


def case_checkpoints(steps):
    """The consolidated state dict equals a plain AdamW's; a sharded one round-trips at the same world size and
    is refused at another on every rank; the consolidated one loads at another world size (a subgroup) and gives back
    the same consolidated state."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ddp, plain = build(make_model(), None, "ddp")
    train(ddp, plain, steps, rank, world_size)
    zero, sharded = build(make_model(), None, "zero2")
    train(zero, sharded, steps, rank, world_size)
    full = sharded.state_dict()
    reference = plain.state_dict()
    same_as_plain = full["param_groups"] == reference["param_groups"] and all(
        torch.equal(bits(full["state"][i][k]), bits(v))
        for i, entries in reference["state"].items()
        for k, v in entries.items()
    )
    mine = sharded.sharded_state_dict()
    again, fresh = build(make_model(), None, "zero2")
    fresh.load_state_dict(mine)
    round_trip = same_nested(fresh.state_dict(), full)
    alone = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group; each loads into its own
    _, smaller = build(make_model(), alone[rank], "zero2")
    refused = caught(smaller.load_state_dict, mine)
    smaller.load_state_dict(full)
    loaded = same_nested(smaller.state_dict(), full)
    return same_as_plain, round_trip, refused, loaded


def same_nested(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_nested(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_nested(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(bits(a), bits(b))
    return a == b


def case_clipping(steps):
    """ShardedOptimizer.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on DDP's gradients: the same
    norm and parameters, up to the order the squares are summed in."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in ("ddp", "zero1", "zero2"):
        ddp, optimizer = build(make_model(), None, stage)
        norms = []
        for step in range(steps):
            x, y = batch(step, rank, world_size)
            nn.functional.mse_loss(ddp(x), y).backward()
            if stage == "ddp":
                norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)))
            else:
                norms.append(float(optimizer.clip_grad_norm_(0.05)))
            optimizer.step()
            optimizer.zero_grad()
        out[stage] = norms, state_of(ddp)
    return out


def case_bad_input():
    """Each error names what is wrong, on every rank; the ranks stay usable after it."""
    rank = dist.get_rank()
    errors = {}
    model = make_model()
    errors["lbfgs"] = caught(ddpkit.ShardedOptimizer, model.parameters(), torch.optim.LBFGS)
    errors["adafactor"] = caught(ddpkit.ShardedOptimizer, model.parameters(), torch.optim.Adafactor)
    changed = nn.Linear(FEATURES + rank, 3)  # a parameter of another shape on rank 1
    errors["changed"] = caught(ddpkit.ShardedOptimizer, changed.parameters(), torch.optim.AdamW)
    ddp = ddpkit.DistributedDataParallel(make_model())
    errors["missing"] = caught(ddpkit.ShardedOptimizer, ddp.module.head.parameters(), torch.optim.AdamW)
    ddpkit.ShardedOptimizer(ddp.parameters(), torch.optim.AdamW)
    errors["hook"] = caught(ddp.register_comm_hook, None, lambda state, bucket: None)
    hooked = ddpkit.DistributedDataParallel(make_model())
    hooked.register_comm_hook(None, lambda state, bucket: None)
    errors["after_hook"] = caught(ddpkit.ShardedOptimizer, hooked.parameters(), torch.optim.AdamW)
    return errors


# --- tests ------------------------------------------------------------------------------------------


def test_alone_equals_a_plain_optimizer_over_ten_adamw_steps(pool):
    for same, same_state, same_keys, lrs in pool(2).run(case_alone_equals_a_plain_optimizer, 10):
        assert same and same_state and same_keys
        assert lrs == [0.01 * 0.5**3, 0.02 * 0.5**3]


def test_zero_equals_ddp_at_world_sizes_2_to_8_and_across_hosts(pool):
    """ZeRO-1 and -2 give DDP's bits on every rank at 2-8 ranks on one host and on 2x2 hosts. Across three
    hosts the ring's order depends on where an element falls (Note [A ring across hosts]), so ZeRO's
    reduce-scatter and DDP's all-reduce may round an element differently there: every rank still ends
    with the same bits, within a few float32 roundings of DDP's (docs/sharding.md states the measured
    difference)."""
    one_host = [(n, None) for n in (2, 3, 4, 5, 8)]
    results = pool(8).run(case_zero_and_ddp, one_host + [(4, "a,a,b,b"), (3, "a,b,c")], STEPS, timeout=300)
    for (_, labels), (_, buckets, topology) in results[0].items():
        assert buckets > 1 and len(topology.hosts) == (1 if labels is None else len(set(labels.split(","))))
    exact = one_host + [(4, "a,a,b,b")]
    differ = [
        (r, key, stage)
        for r, per in enumerate(results)
        for key in exact
        if key in per
        for stage in ("zero1", "zero2")
        if not same_bits(per[key][0]["ddp"], per[key][0][stage])
    ]
    assert not differ
    three_hosts = [per[(3, "a,b,c")][0] for per in results[:3]]
    for stage in ("zero1", "zero2"):
        assert all(same_bits(three_hosts[0][stage], other[stage]) for other in three_hosts[1:])
        for name, value in three_hosts[0]["ddp"].items():
            difference = (three_hosts[0][stage][name] - value).abs().max().item()
            assert difference <= 1e-5 * max(1.0, value.abs().max().item()), (stage, name, difference)


def test_accumulation_unused_and_frozen_parameters_keep_ddps_bits(pool):
    assert pool(2).run(case_rules_as_ddp, 4) == [[], []]


def test_checkpoints_consolidated_and_sharded(pool):
    results = pool(2).run(case_checkpoints, 3)
    assert all(same_as_plain and round_trip for same_as_plain, round_trip, _, _ in results)
    for rank, (_, _, refused, loaded) in enumerate(results):
        assert f"rank {rank}'s of a world of 2; this optimizer is rank 0 of 1" in refused and loaded


def test_clipping_the_sharded_gradients_clips_as_torch_does(pool):
    for out in pool(2).run(case_clipping, 3):
        norms, expected = out["ddp"]
        assert min(norms) > 0.05  # it clipped
        for stage in ("zero1", "zero2"):
            torch.testing.assert_close(torch.tensor(out[stage][0]), torch.tensor(norms), rtol=1e-5, atol=0)
            for name, value in expected.items():
                torch.testing.assert_close(out[stage][1][name], value, rtol=1e-5, atol=1e-6)


def test_bad_input_raises_on_every_rank(pool):
    for errors in pool(2).run(case_bad_input):
        assert "LBFGS does not update each element on its own" in errors["lbfgs"]
        assert "Adafactor does not update each element on its own" in errors["adafactor"]
        assert "parameter 0 of param group 0 differs between ranks" in errors["changed"]
        assert "does not hold (first: 'embed.weight')" in errors["missing"]
        assert "reduce-scattered instead" in errors["hook"]
        assert "use one or the other" in errors["after_hook"]
