"""The worker: what runs the model on one rank, the same on every rank.

- `worker.Worker`: one rank's whole life: the platform setup, joining the tensor-parallel
  group, its shard of the model, its caches and (on the rank that receives the steps) the
  runner; `execute(step)` on that rank, `handle(command)` on the others.
- `platform`: the process's CPU setup, done once per rank: thread count, the thread governor,
  denormals flushed to zero (`cpu_threads`: the thread count and the governor themselves);
  `huge_pages`: CPU memory on transparent huge pages for the weights and the caches.
- `caches`: a shard's cache specs, its state and KV caches, and `CacheCopies`, the slot and
  block copies the runner asks for (made here, or on every rank through `relay`).
- `relay`: rank 0's model calls and cache copies sent to the other ranks first, and the
  commands both ends speak.
- `step`: the step as plain data (`Step` in, `StepResult` out): what crosses from the engine
  to a worker, picklable.
- `model_runner`: one step on the model (flat batch, metadata, forward, sampling), and the
  sampling generators of seeded sequences, kept by sequence id.
- `cuda_graphs`: captured decode forwards (CUDA, backends that declare them capturable).

Nothing here imports `executor` or `engine`: an executor builds `Worker`s and hands rank 0's
the function that sends a command to the other ranks; the engine sends steps as data.
"""
