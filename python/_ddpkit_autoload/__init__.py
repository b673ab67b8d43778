"""The "ddpkit" torch.distributed backend, named at ``import torch``: torch's backend autoload entry point.

pyproject.toml declares ``register`` in the entry-point group ``torch.backends``, which torch calls at the end
of ``import torch`` (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). It tells torch.distributed the backend's name
and nothing more: ddpkit itself, and its C++ extension, load when a process group is first created on the
backend. So ``dist.init_process_group("ddpkit")`` works in a process that never imported ddpkit (what
frameworks that create the group from a string need, Ray Train's ``TorchConfig(backend="ddpkit")`` among them),
and a process that never uses the backend pays only for this module. This is a package of its own, not a
module of ddpkit's: importing any module of ddpkit runs ddpkit's ``__init__``, which loads the extension.
docs/clusters.md gives the time it adds to ``import torch`` (benchmarks/bench_import.py).
"""

import warnings

NAME = "ddpkit"


def register() -> None:
    """Registers the backend's name with a creator that imports ddpkit on first use. torch turns an exception
    here into a failed ``import torch``: anything that goes wrong is a warning instead."""
    try:
        import torch.distributed as dist

        if dist.is_available() and NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
    except Exception as error:  # noqa: BLE001 - import torch must not fail because of ddpkit
        warnings.warn(f"ddpkit: the backend was not registered at import torch ({error!r})", stacklevel=2)


def _create(backend_options, options):
    from ddpkit import backend  # loads the extension; import ddpkit keeps this registration

    return backend._create_with_options(backend_options, options)
