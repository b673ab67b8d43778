"""Fault-tolerant training with torchft on ddpkit's process group: replica groups that lose a member keep
training, and a replica that (re)joins receives the model, optimizer and step from a healthy peer.

Start the lighthouse, then one torchrun per replica group (here two groups of one rank; add more, or
kill one and start it again: the others go on without it and it catches up):

    torchft_lighthouse --min_replicas 1 --bind [::]:29510 --join_timeout_ms 1000 --heartbeat_timeout_ms 1000
    TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=0 torchrun --nproc-per-node 1 --master-port 29600 examples/fault_tolerance.py
    TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=1 torchrun --nproc-per-node 1 --master-port 29601 examples/fault_tolerance.py

Each replica trains a small MLP for STEPS committed steps with torchft's Manager, DDP and optimizer
wrappers over ``ddpkit.torchft.ProcessGroupDdpkit``, and prints its parameters' checksum at the end:
every replica prints the same one. docs/fault_tolerance.md explains the pieces.
"""

import datetime
import os

import torch
from torch import nn
from torchft import Manager
from torchft.optim import OptimizerWrapper

# torchft's DDP wrapper, with a gradient hook that lets each bucket's all-reduce overlap backward
from ddpkit.torchft import DistributedDataParallel, ProcessGroupDdpkit, check_lighthouse

STEPS = int(os.environ.get("STEPS", "50"))


def main() -> None:
    lighthouse = check_lighthouse()  # a clear error when it is not running
    replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    torch.manual_seed(0)  # the same model on every replica: no sync needed at step 0 (init_sync=False)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    timeout = datetime.timedelta(seconds=10)

    def load_state_dict(state: dict) -> None:  # a joining replica's state, from a healthy peer
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    manager = Manager(
        pg=ProcessGroupDdpkit(timeout=timeout),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{replica}",
        lighthouse_addr=lighthouse,
        timeout=timeout,
        init_sync=False,
    )
    ddp_model = DistributedDataParallel(manager, model)
    optim = OptimizerWrapper(manager, optimizer)
    while manager.current_step() < STEPS:
        optim.zero_grad()  # starts the step's quorum
        generator = torch.Generator().manual_seed(1000 * replica + manager.current_step())
        x, y = torch.randn(32, 16, generator=generator), torch.randn(32, 4, generator=generator)
        nn.functional.mse_loss(ddp_model(x), y).backward()  # averaged over the quorum's replicas
        optim.step()  # applied only when the whole quorum committed the step
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"replica {replica}: {manager.current_step()} steps, parameter checksum {checksum:.12f}", flush=True)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
