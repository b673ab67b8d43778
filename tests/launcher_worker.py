"""One task of a job that tests/test_launchers.py starts as a launcher would: ``ddpkit.init_distributed()``
under each launcher's variables in turn.

    python tests/launcher_worker.py PHASES

PHASES is a JSON list; each phase is ``{"env": {...}, "backend": ..., "timeout": ...}``. For each, this process
sets the phase's variables (the previous phase's are removed first: the test starts it with no launcher's
variables at all), initializes the default group, all-reduces rank + 1, and destroys the group. It prints
one JSON line per phase: DistInfo's fields and the sum, or the error as "Type: message"; and how long the
initialization took either way.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ddpkit


def run_phase(phase: dict) -> dict:
    started = time.monotonic()
    try:
        info = ddpkit.init_distributed(phase.get("backend", "gloo"), timeout=phase.get("timeout", 60.0))
    except Exception as error:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
    seconds = time.monotonic() - started
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {**info.__dict__, "sum": total.item(), "seconds": seconds}


def main() -> None:
    torch.set_num_threads(1)
    previous: dict = {}
    for phase in json.loads(sys.argv[1]):
        for name in previous:
            os.environ.pop(name, None)
        os.environ.update(phase["env"])
        previous = phase["env"]
        print(json.dumps(run_phase(phase)), flush=True)


if __name__ == "__main__":
    main()
