"""Writes the benchmark model: a `mamba-130m-hf`-shaped MambaForCausalLM with random weights.

24 layers, hidden 768, state 16, conv 4, expand 2, vocab 50,280, float32, tied embeddings,
saved with `save_pretrained` beside the GPT-NeoX tokenizer of the `state-spaces/mamba-*-hf`
checkpoints. Default initialisation gives near-constant outputs, so every weight except
`A_log`, `D` and the norms is re-drawn from a seeded normal, as `tests/tiny_models.py` does.

    python benchmarks/make_model.py /tmp/mamba-130m-random
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


def build_model(seed: int = 0, std: float = 0.1):  # noqa: ANN201 - transformers model
    """The float32 `MambaForCausalLM` of the `mamba-130m-hf` shape with varied random weights.

    Args:
        seed: seed of the initialisation and of the re-drawn weights.
        std: standard deviation of the re-drawn weights.
    """
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    config = MambaConfig(**MAMBA_130M, architectures=["MambaForCausalLM"])
    model = MambaForCausalLM(config).eval().float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", ".D")) or "norm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def write_model(path: str, seed: int = 0) -> str:
    """Saves the model and the tokenizer into `path` (created if missing); returns `path`."""
    model = build_model(seed)
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
    args = parser.parse_args()
    path = write_model(args.path, args.seed)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"wrote {path} ({size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
