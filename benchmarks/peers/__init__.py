"""External all-reduce implementations benchmarked beside ddpkit (see benchmarks/README.md)."""
