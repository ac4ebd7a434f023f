"""Every environment switch of vllm_mamba, read in this one module (a leaf: no imports from
the package).

Each is read when asked for (`envs.VLLM_MAMBA_HUGE_PAGES`), so a test or a caller may set the
variable at any time before the code that reads it runs. `VLLM_MAMBA_FUSED_DECODE` and
`VLLM_MAMBA_CHAIN_LOG` are read when a state cache binds a model and its layers' decode plans
are made (`layers/decode_plan`).

| variable | default | what it does |
|---|---|---|
| `VLLM_MAMBA_OPS` | (auto) | force the kernel backend: `ref`, `cpp` or `triton` |
| `VLLM_MAMBA_FUSED_DECODE` | `1` | `0` turns off the fused C++ decode layers, grouped experts |
| `VLLM_MAMBA_CHAIN_LOG` | `1` | `0`: fused GDN chains write every position's state |
| `VLLM_MAMBA_ONEDNN_LINEAR` | `1` | `0` turns off oneDNN's linear op for the float GEMMs |
| `VLLM_MAMBA_HUGE_PAGES` | `1` | `0` keeps weights and caches on ordinary pages |
| `VLLM_MAMBA_DIST_TIMEOUT_S` | `120` | seconds a tensor-parallel collective waits for a rank |
| `VLLM_MAMBA_CONFIGURE_LOGGING` | `1` | `0` leaves the `vllm_mamba` logger unconfigured |
| `VLLM_MAMBA_API_KEY` | (none) | the server's API key when `--api-key` is not given |
| `VLLM_MAMBA_CPU_ISA` | (best) | force a lower CPU kernel level (`vllm_mamba.ops.cpu_isa`) |

Build time only (read by `setup.py`, which cannot import the package): `VLLM_MAMBA_NO_EXT=1`
builds without the C++ extensions; `VLLM_MAMBA_CPU_ISAS` picks the kernel levels (`native`:
generic and this CPU's best, the default of a local build; `supported`: every level this CPU
runs; `all`: every level of the architecture, the default of a wheel; or a list such as
`avx2,avx512`; no build uses `-march=native`); `VLLM_MAMBA_BUILD_VERBOSE=1` shows the
compiler's warnings.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _flag(name: str, default: str = "1") -> Callable[[], bool]:
    return lambda: os.environ.get(name, default).strip() != "0"


environment_variables: dict[str, Callable[[], Any]] = {
    "VLLM_MAMBA_OPS": lambda: os.environ.get("VLLM_MAMBA_OPS", "").strip().lower(),
    "VLLM_MAMBA_FUSED_DECODE": _flag("VLLM_MAMBA_FUSED_DECODE"),
    "VLLM_MAMBA_CHAIN_LOG": _flag("VLLM_MAMBA_CHAIN_LOG"),
    "VLLM_MAMBA_ONEDNN_LINEAR": _flag("VLLM_MAMBA_ONEDNN_LINEAR"),
    "VLLM_MAMBA_HUGE_PAGES": _flag("VLLM_MAMBA_HUGE_PAGES"),
    "VLLM_MAMBA_DIST_TIMEOUT_S": lambda: float(os.environ.get("VLLM_MAMBA_DIST_TIMEOUT_S", "120")),
    "VLLM_MAMBA_CONFIGURE_LOGGING": _flag("VLLM_MAMBA_CONFIGURE_LOGGING"),
    "VLLM_MAMBA_API_KEY": lambda: os.environ.get("VLLM_MAMBA_API_KEY") or None,
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(environment_variables)
