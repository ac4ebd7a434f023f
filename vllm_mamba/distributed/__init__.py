"""Tensor parallelism: the process group of one engine's ranks and its collectives.

- `parallel_state`: which rank this process is, of how many (`TensorParallel`), and setting
  up / tearing down the torch.distributed group (gloo on the CPU, NCCL on CUDA).
- `communication`: the collectives the sharded layers call (all-reduce, all-gather,
  broadcast from rank 0); every one is the identity when there is one rank.
"""
