"""The worker: what runs the model on one rank, the same on every rank.

- `worker.Worker`: one rank's whole life: the platform setup, joining the tensor-parallel
  group, its shard of the model, its caches and its runner; `execute(step)`, on ranks 1..N-1
  through `handle(command)` (rank 0's calls, sent by its executor).
- `platform`: the process's CPU setup, done once per rank: thread count, the thread governor,
  denormals flushed to zero (`cpu_threads`: the thread count and the governor themselves);
  `huge_pages`: CPU memory on transparent huge pages for the weights and the caches.
- `caches`: a shard's cache specs, its state and KV caches, and `CacheCopies`, the slot and
  block copies the runner asks for.
- `relay`: the commands rank 0's executor sends the other ranks (the calls it makes on rank
  0's worker, the step among them), so every rank runs the same worker code.
- `step`: the step as plain data (`Step` in, `StepResult` out): what crosses from the engine
  to a worker, picklable.
- `model_runner`: one step on the model (flat batch, metadata, forward, sampling), and the
  sampling generators of seeded sequences, kept by sequence id.
- `cuda_graphs`: captured decode forwards (CUDA, backends that declare them capturable).

Nothing here imports `executor` or `engine`: an executor builds a `Worker` per rank and sends
ranks 1..N-1 rank 0's calls; the engine sends steps as data.
"""
