"""Writes a benchmark model with random weights: `mamba-130m-hf`-, `mamba2-130m`- or
`rwkv7-0.4B-world`-shaped.

- `--arch mamba` (default): MambaForCausalLM, 24 layers, hidden 768, state 16, conv 4,
  expand 2, vocab 50,280, tied embeddings.
- `--arch mamba2`: Mamba2ForCausalLM, 24 layers, hidden 768, expand 2, 24 heads of 64, one
  group, state 128, conv 4, SSD chunks of 256, vocab 50,288, tied embeddings.
- `--arch rwkv7`: RWKV7ForCausalLM in fla-hub's layout (fla-hub/rwkv7-0.4B-world's config:
  24 layers, hidden 1024, heads of 64, channel mix 4096, vocab 65,536, LoRA ranks decay 64,
  a 64, v 32, gate 128, untied head), `model.safetensors` + `config.json`, and the same
  weights in BlinkDL's layout as `<dir name>.pth` (for the `rwkv` package; the engine reads
  `config.json` when both are there), beside the installed `rwkv` package's World vocabulary
  `rwkv_vocab_v20230424.txt` (the engine's and llama.cpp's converter's tokenizer). Not in
  transformers: drawn by `tests/helpers/rwkv_checkpoints.py` at the released models' scales.

Float32, saved with `save_pretrained` beside the GPT-NeoX tokenizer of the
`state-spaces/mamba-*-hf` checkpoints. Default initialisation gives near-constant outputs, so
every weight except `A_log`, `D`, `dt_bias` and the norms is re-drawn from a seeded normal, as
`tests/tiny_models.py` does.

    python benchmarks/make_model.py /tmp/mamba-130m-random
    python benchmarks/make_model.py /tmp/mamba2-130m-random --arch mamba2
    python benchmarks/make_model.py /tmp/rwkv7-0.4b-random --arch rwkv7
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

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

# fla-hub/rwkv7-0.4B-world's config.json (fla's field names)
RWKV7_04B = dict(
    hidden_size=1024,
    num_hidden_layers=24,
    head_dim=64,
    intermediate_size=4096,
    vocab_size=65536,
    decay_low_rank_dim=64,
    a_low_rank_dim=64,
    v_low_rank_dim=32,
    gate_low_rank_dim=128,
)
RWKV_VOCAB = "rwkv_vocab_v20230424.txt"

# architecture -> (transformers config class, model class, shape)
ARCHS = {
    "mamba": ("MambaConfig", "MambaForCausalLM", MAMBA_130M),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", MAMBA2_130M),
}
OTHER_ARCHS = ["rwkv7"]  # not in transformers: written by their own path below


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


def write_rwkv7(path: str, seed: int = 0) -> str:
    """The RWKV-7 0.4B-shaped model in both layouts and the World vocabulary, into `path`."""
    import json

    import rwkv
    from safetensors.torch import save_file

    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    from tests.helpers.rwkv_checkpoints import rwkv7_state_dict, to_fla_layout

    os.makedirs(path, exist_ok=True)
    sd = rwkv7_state_dict(RWKV7_04B, seed)
    torch.save(sd, os.path.join(path, os.path.basename(os.path.normpath(path)) + ".pth"))
    fla = {k: v.contiguous() for k, v in to_fla_layout(sd).items()}
    save_file(fla, os.path.join(path, "model.safetensors"))
    config = {
        "model_type": "rwkv7",
        "architectures": ["RWKV7ForCausalLM"],
        **RWKV7_04B,
        "hidden_act": "sqrelu",
        "norm_eps": 1e-5,
        "norm_bias": True,
        "norm_first": True,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    shutil.copy(os.path.join(os.path.dirname(rwkv.__file__), RWKV_VOCAB), path)
    return path


def write_model(path: str, seed: int = 0, arch: str = "mamba") -> str:
    """Saves the model and the tokenizer into `path` (created if missing); returns `path`."""
    if arch == "rwkv7":
        return write_rwkv7(path, seed)
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
    parser.add_argument(
        "--arch", default="mamba", choices=sorted(ARCHS) + OTHER_ARCHS, help="model shape"
    )
    args = parser.parse_args()
    path = write_model(args.path, args.seed, args.arch)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"wrote {path} ({size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
