"""Writes a benchmark model with random weights: `mamba-130m-hf`- or `mamba2-130m`-shaped.

- `--arch mamba` (default): MambaForCausalLM, 24 layers, hidden 768, state 16, conv 4,
  expand 2, vocab 50,280, tied embeddings.
- `--arch mamba2`: Mamba2ForCausalLM, 24 layers, hidden 768, expand 2, 24 heads of 64, one
  group, state 128, conv 4, SSD chunks of 256, vocab 50,288, tied embeddings.

Float32, saved with `save_pretrained` beside the GPT-NeoX tokenizer of the
`state-spaces/mamba-*-hf` checkpoints. Default initialisation gives near-constant outputs, so
every weight except `A_log`, `D`, `dt_bias` and the norms is re-drawn from a seeded normal, as
`tests/tiny_models.py` does.

    python benchmarks/make_model.py /tmp/mamba-130m-random
    python benchmarks/make_model.py /tmp/mamba2-130m-random --arch mamba2
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(REPO_ROOT, "tests", "data", "gpt-neox-20b-tokenizer")
DEFAULT_DIR = "/tmp/mamba-130m-random"

MAMBA_130M = dict(
    hidden_size=768,
    num_hidden_layers=24,
    state_size=16,
    conv_kernel=4,
    expand=2,
    vocab_size=50280,
    use_bias=False,
    use_conv_bias=True,
    residual_in_fp32=True,
    tie_word_embeddings=True,
    layer_norm_epsilon=1e-5,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)

MAMBA2_130M = dict(
    hidden_size=768,
    num_hidden_layers=24,
    expand=2,
    num_heads=24,
    head_dim=64,
    n_groups=1,
    state_size=128,
    conv_kernel=4,
    chunk_size=256,
    vocab_size=50288,
    use_bias=False,
    use_conv_bias=True,
    residual_in_fp32=True,
    tie_word_embeddings=True,
    layer_norm_epsilon=1e-5,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)

# architecture -> (transformers config class, model class, shape)
ARCHS = {
    "mamba": ("MambaConfig", "MambaForCausalLM", MAMBA_130M),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", MAMBA2_130M),
}


def build_model(seed: int = 0, std: float = 0.1, arch: str = "mamba"):  # noqa: ANN201
    """The float32 transformers model of `ARCHS[arch]` with varied random weights.

    Args:
        seed: seed of the initialisation and of the re-drawn weights.
        std: standard deviation of the re-drawn weights.
        arch: "mamba" or "mamba2".
    """
    import transformers

    config_name, model_name, shape = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**shape, architectures=[model_name])
    model = getattr(transformers, model_name)(config).eval().float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", ".D", "dt_bias")) or "norm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def write_model(path: str, seed: int = 0, arch: str = "mamba") -> str:
    """Saves the model and the tokenizer into `path` (created if missing); returns `path`."""
    model = build_model(seed, arch=arch)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    for file in os.listdir(TOKENIZER_DIR):
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", default=DEFAULT_DIR, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--arch", default="mamba", choices=sorted(ARCHS), help="model shape")
    args = parser.parse_args()
    path = write_model(args.path, args.seed, args.arch)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"wrote {path} ({size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
