"""Week-4 Task 1: ``torchrun --nproc_per_node N sequential_print.py [--num-iter K] [--order ...]``.

See ddpkit/sequential_print.py for the implementation.
"""

from ddpkit.sequential_print import main

if __name__ == "__main__":
    main()
