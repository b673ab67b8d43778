"""The training application built on ddpkit: datasets (``data``), models (``models``), the run's settings
(``config``), its command line (``cli``) and the trainer (``train``), which sets up a rank's data
(``run_data``) and model (``model_setup``), evaluates (``evaluation``) and checkpoints (``checkpoints``).

The library (``ddpkit.comm``, ``ddpkit.syncbn``, ``ddpkit.ddp``, ``ddpkit.launch``) does not import
this package; ``import ddpkit`` leaves it unloaded. The one entry point is ``main``, which
``python -m ddpkit.training`` runs (``__main__.py``) and the repository's ``train.py`` calls::

    torchrun --nproc_per_node 2 -m ddpkit.training --dataset fashion_mnist --epochs 10 --accumulation-steps 2
    torchrun --nproc_per_node 2 train.py --dataset fashion_mnist --epochs 10 --accumulation-steps 2   # the same
"""

from .cli import parse_args
from .config import TrainConfig
from .train import Trainer, main

__all__ = ["TrainConfig", "Trainer", "main", "parse_args"]
