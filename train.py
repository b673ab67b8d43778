"""Training entry point: ``torchrun --nproc_per_node N train.py [options]`` (see python/ddpkit/training/cli.py).

torchrun --nproc_per_node 2 train.py --dataset fashion_mnist --epochs 10 --accumulation-steps 2
torchrun --nproc_per_node 2 train.py --impl torch --dataset fashion_mnist --epochs 10 --accumulation-steps 2
torchrun --nproc_per_node 2 train.py --shard gradients --global-batch-size 128 --epochs 10   # ZeRO-2 (docs/sharding.md)
"""

from ddpkit.training import main

if __name__ == "__main__":
    main()
