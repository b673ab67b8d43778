"""``python -m ddpkit.training`` and ``torchrun --nproc_per_node N -m ddpkit.training``: the trainer of an
installed ddpkit, no repository needed (``--help`` lists the options)."""

from .train import main

if __name__ == "__main__":
    main()
