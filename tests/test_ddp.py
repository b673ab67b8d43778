"""ddpkit.DistributedDataParallel against single-process training, on real gloo groups."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.ddp import assign_buckets

GLOBAL_BATCH = 16
FEATURES = 12
STEPS = 5
MiB = 2**20


# --- bucket assignment (pure) ---------------------------------------------------------------------

def test_buckets_fill_in_reverse_order_with_a_small_first_bucket():
    sizes = [4 * MiB, 1 * MiB, 2 * MiB, 512 * 1024, 512 * 1024]
    assert assign_buckets(sizes, [0] * 5, 3 * MiB, 1 * MiB) == [2, 1, 1, 0, 0]


def test_a_bucket_closes_once_its_cap_is_reached():
    # visited last to first: the 100-byte parameter overshoots the open bucket, which then closes
    assert assign_buckets([100, 10, 10], [0, 0, 0], 50, 50) == [0, 0, 0]
    assert assign_buckets([10, 100, 10], [0, 0, 0], 50, 50) == [1, 0, 0]
    assert assign_buckets([10, 10, 100], [0, 0, 0], 50, 50) == [1, 1, 0]


def test_kinds_never_share_a_bucket_and_left_out_parameters_get_none():
    bucket_of = assign_buckets([8, 8, 8, 8, 8], [0, 1, 0, 0, 1], 1000, 1000, included=[True, True, False, True, True])
    assert bucket_of[2] == -1
    assert bucket_of[0] == bucket_of[3] and bucket_of[1] == bucket_of[4] and bucket_of[0] != bucket_of[1]
    assert sorted(set(bucket_of) - {-1}) == [0, 1]
    assert bucket_of[4] == 0  # the last parameter's bucket is opened first


def test_bucket_caps_must_be_positive():
    with pytest.raises(RuntimeError, match="caps must be positive"):
        assign_buckets([1], [0], 0, 1)
    assert assign_buckets([], [], 1, 1) == []


def test_negative_kinds_are_refused_not_read_as_frozen():
    with pytest.raises(RuntimeError, match="kinds must be >= 0.*included"):
        assign_buckets([8, 8], [0, -1], 1000, 1000)
    with pytest.raises(RuntimeError, match="same length"):
        assign_buckets([8, 8], [0, 0], 1000, 1000, included=[True])


def test_reducer_takes_named_options_with_defaults():
    # Only the three required options, by name: the defaults fill the rest and the constructor gets as
    # far as looking up the group (none is registered in this process).
    with pytest.raises(RuntimeError, match="no process group named 'nowhere'"):
        torch.classes.ddpkit.Reducer(parameters=[], bucket_of_param=[], group_name="nowhere")
    with pytest.raises(RuntimeError, match="algorithm"):
        torch.classes.ddpkit.Reducer([], [], "nowhere", algorithmm="ring")
