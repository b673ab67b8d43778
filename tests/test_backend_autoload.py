"""The "ddpkit" backend by name without ``import ddpkit``: torch's backend autoload entry point
(python/_ddpkit_autoload, pyproject.toml's "torch.backends" entry point). Fresh interpreters, since this
one imported ddpkit long ago."""

import json
import os
import subprocess
import sys

from helpers import communicate_all, free_port

# Two ranks that never import ddpkit: import torch leaves the extension unloaded, the group loads it.
WITHOUT_IMPORT = """
import json, sys
import torch, torch.distributed as dist
before = sorted(m for m in sys.modules if "ddpkit" in m and not m.startswith("_editable"))
rank = int(sys.argv[1])
dist.init_process_group("ddpkit", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(json.dumps({"before": before, "backend": dist.get_backend(), "sum": total.item(),
                  "loaded": "ddpkit._C" in sys.modules}))
dist.destroy_process_group()
"""

# TORCH_DEVICE_BACKEND_AUTOLOAD=0: the name is unknown until import ddpkit, which registers it as before.
AUTOLOAD_OFF = """
import json
import torch, torch.distributed as dist
try:
    dist.init_process_group("ddpkit", store=dist.HashStore(), rank=0, world_size=1)
    unknown = None
except Exception as error:
    unknown = f"{type(error).__name__}: {error}"
import ddpkit
dist.init_process_group("ddpkit", store=dist.HashStore(), rank=0, world_size=1)
print(json.dumps({"unknown": unknown, "backend": dist.get_backend()}))
dist.destroy_process_group()
"""


def python(code, *args, **env):
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_process_that_never_imports_ddpkit_creates_a_group_on_it():
    port = free_port()
    processes = [python(WITHOUT_IMPORT, rank, port) for rank in (0, 1)]
    processes.append(python(AUTOLOAD_OFF, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    outputs = communicate_all(processes, timeout=120)
    for process, (_, err) in zip(processes, outputs):
        assert process.returncode == 0, err
    *ranks, off = [json.loads(out.splitlines()[-1]) for out, _ in outputs]
    for rank in ranks:
        # import torch ran the entry point's module alone; the group loaded the extension
        assert rank == {"before": ["_ddpkit_autoload"], "backend": "ddpkit", "sum": 3.0, "loaded": True}
    assert "Unknown backend type ddpkit" in off["unknown"] and off["backend"] == "ddpkit"
