"""What rank 0's executor sends ranks 1..N-1 under tensor parallelism: the calls it makes on rank
0's `Worker`, so that every rank runs the same worker code on the same data.

A distributed executor sends each command to every other rank, in order, before making the same
call on rank 0's worker; each other rank runs it in `Worker.handle`:

- `("init_caches", num_slots, sizing)`: at startup; each rank allocates the caches of its own
  shard's specs (`caches.make_caches`) and binds them to its layers.
- `("init_runner", runner_config)`: each rank builds its runner with the engine's decisions.
- `("execute", step)`: the step, plain data (`step.Step`); each rank lays out the same batch,
  makes the same copies, runs its shard (joining the layers' collectives, so every rank
  advances its part of the state), scores its vocabulary rows (all-gathered) and samples the
  same tokens from the same generators; rank 0's result goes back to the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Command = tuple[Any, ...]
Send = Callable[[Command], None]

COMMANDS = ("init_caches", "init_runner", "execute")
