"""How model configs name the Mamba2 mixer's shapes, and the config checks every family with
state-space layers shares.

- `mamba2_args_from_mamba_prefix`: `Mamba2Mixer` arguments from the `mamba_*` config names
  (Bamba, Granite 4.0-H, Falcon-H1).
- `check_mamba2_args`: heads, head dim, groups and width fit together.
- `check_silu`: the conv activation is SiLU (what the kernels apply).
- `attention_head_dim`: the config's attention head dim.
"""

from __future__ import annotations

from typing import Any


def mamba2_args_from_mamba_prefix(config: Any) -> dict[str, Any]:
    """`Mamba2Mixer` arguments (without `ops`) from the `mamba_*` config names."""
    limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
    return dict(
        hidden_size=config.hidden_size,
        num_heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        n_groups=config.mamba_n_groups,
        state_size=config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size,
        time_step_limit=tuple(limit),
        use_bias=config.mamba_proj_bias,
        use_conv_bias=config.mamba_conv_bias,
        norm_eps=config.rms_norm_eps,
    )


def check_mamba2_args(args: dict[str, Any], intermediate: int) -> None:
    """Raises ValueError when the Mamba2 shapes do not fit together."""
    if args["num_heads"] * args["head_dim"] != intermediate:
        raise ValueError(
            f"Mamba2 heads ({args['num_heads']}) x head dim ({args['head_dim']}) must equal the "
            f"Mamba intermediate size ({intermediate})"
        )
    if args["num_heads"] % args["n_groups"]:
        raise ValueError(
            f"Mamba2 heads ({args['num_heads']}) must be a multiple of its groups "
            f"({args['n_groups']})"
        )


def check_silu(config: Any, key: str = "hidden_act") -> None:
    """Raises ValueError when the conv activation is not SiLU (the kernels apply SiLU)."""
    act = getattr(config, key, "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{key} {act!r} is not supported; the kernels apply SiLU")


def attention_head_dim(config: Any) -> int:
    """The attention head dim: `head_dim`, else `hidden_size / num_attention_heads`."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
