"""The tiny hybrid checkpoints of the GGUF mapping tests and their F32 GGUFs (llama.cpp's
converter), built once per test session.

Each case is a variant of `tests.tiny_models` (the same configs and weight draws), with a few
config keys changed where llama.cpp's converter cannot write the registry's variant as it is
(said at each case), and a vocabulary of `VOCAB` tokens: the GPT-NeoX tokenizer's first
`VOCAB` tokens and the merges among them (`neox_tokenizer_cut`; reading a GGUF's 50k
tokens and merges with gguf-py takes seconds per file). All of them are converted by one
converter process (`convert_checkpoints.py`) on first use.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from unittest import mock

import torch

from tests import tiny_models
from tests.helpers.tmp_dirs import make_tmp_dir, session_cache

LLAMA_CPP_DIR = os.path.join(os.path.dirname(__file__), "..", "..", ".cache", "llama-cpp-convert")


VOCAB = 2048


@dataclasses.dataclass(frozen=True)
class Case:
    """One GGUF architecture's checkpoint: a registry variant with config keys changed."""

    arch: str  # the GGUF general.architecture the converter writes
    variant: str  # the `tests.tiny_models` variant
    overrides: dict = dataclasses.field(default_factory=dict)  # config keys changed
    # config.json as the releases spell it (transformers 5 saves some keys in a newer form the
    # converter does not read): keys set, and keys removed.
    hub_keys: dict = dataclasses.field(default_factory=dict)
    drop_keys: tuple[str, ...] = ()
    # `neox`: the registry's GPT-NeoX tokenizer; `llama-bytes`: `llama_byte_tokenizer`.
    tokenizer: str = "neox"
    # tensor name parts renamed in the saved checkpoint (the releases' layout)
    tensor_names: dict = dataclasses.field(default_factory=dict)
    mtp: bool = False  # a Qwen3.5 multi-token-prediction head added (`add_mtp_head`)


CASES: dict[str, Case] = {
    # GDN value heads of 32 (16 in the registry): a head spans whole Q8_0 groups, as the
    # releases' 128, so out_proj's head-by-head column reorder keeps its blocks.
    "qwen35": Case("qwen35", "qwen3_5-gqa", {"linear_value_head_dim": 32}),
    # Qwen3.5 as released, with its multi-token-prediction head (which the converter writes as
    # one more block): another shape (tied, one value head per key head, partial rotary).
    "qwen35-mtp": Case("qwen35", "qwen3_5-mqa", hub_keys={"mtp_num_hidden_layers": 1}, mtp=True),
    "qwen35moe": Case("qwen35moe", "qwen3_5-moe-top2"),
    "qwen3next": Case("qwen3next", "qwen3-next-moe"),
    "lfm2": Case("lfm2", "lfm2-gqa"),
    # The converter writes LFM2-MoE with a tied head only (as the releases; an `lm_head` is
    # "Can not map"), no conv biases (it squeezes every conv tensor to 2-D) and no routing
    # scale (llama.cpp runs it with 1.0, as the releases set).
    "lfm2moe": Case(
        "lfm2moe", "lfm2-moe-top2", {"tie_word_embeddings": True, "routed_scaling_factor": 1.0}
    ),
    # Granite 4.0-H as released: NoPE (llama.cpp runs Granite hybrids without rotary
    # embeddings) and `layer_types` spelt `mamba` / `attention`, which the converter reads.
    "granitehybrid": Case(
        "granitehybrid",
        "granite-moe-rope",
        {"position_embedding_type": "nope"},
        hub_keys={"layer_types": ["mamba", "attention", "mamba", "attention"]},
    ),
    # Bamba's rotary width as Bamba-9B's config.json gives it (`attn_rotary_emb`: half the
    # head, which transformers hardcodes; without it the converter writes the whole head).
    "bamba": Case("granitehybrid", "bamba-gqa", hub_keys={"attn_rotary_emb": 8}),
    # Dense Nemotron-H: transformers 5 writes MoE defaults into its config, and the converter
    # then writes it as `nemotron_h_moe` (with no MLP width in the metadata).
    "nemotron_h": Case("nemotron_h_moe", "nemotron-h-dense"),
    # The converter asserts a Mamba2 width that is a multiple of 64: 4 heads of 32 here; and
    # in a MoE model it writes no width for dense MLP layers, so none here (as Nemotron 3
    # Nano's pattern, Mamba2, MoE and attention only).
    "nemotron_h_moe": Case(
        "nemotron_h_moe",
        "nemotron-h-moe",
        {"mamba_num_heads": 4, "mamba_head_dim": 32, "hybrid_override_pattern": "ME*MEE"},
    ),
    # llama.cpp's Mamba2 layer gates before its norm (as the releases): the norm after the gate.
    "falcon-h1": Case("falcon-h1", "falcon-h1-norm", {"mamba_norm_before_gate": False}),
    # The converter writes Jamba's vocabulary as SentencePiece-style (`llama`) only, from a
    # `tokenizer.model` or a byte-fallback BPE `tokenizer.json`: a byte-level one here, with
    # the model's vocabulary cut to its 320 tokens.
    "jamba": Case("jamba", "jamba-gqa", {"vocab_size": 320}, tokenizer="llama-bytes"),
    # The converter reads Moonshot's layout (`linear_attn_config`, `first_k_dense_replace`,
    # `num_shared_experts`, dense layers as `mlp.*`), as Kimi-Linear-48B ships it; it writes
    # no expert group count, so one group (as the release).
    "kimi-linear": Case(
        "kimi-linear",
        "kimi-linear-moe",
        {"n_group": 1},
        hub_keys={
            "linear_attn_config": {
                "full_attn_layers": [2],
                "kda_layers": [1, 3, 4],
                "short_conv_kernel_size": 4,
                "head_dim": 16,
                "num_heads": 4,
            },
            "first_k_dense_replace": 1,
            "num_shared_experts": 1,
        },
        tensor_names={
            f"block_sparse_moe.{p}_proj": f"mlp.{p}_proj" for p in ("gate", "up", "down")
        },
    ),
}


def llama_cpp_dir() -> str:
    """The converter's tree that `make install-dev` fetches (`.cache/llama-cpp-convert`)."""
    if not os.path.isfile(os.path.join(LLAMA_CPP_DIR, "convert_hf_to_gguf.py")):
        raise FileNotFoundError(
            f"llama.cpp's converter is missing ({LLAMA_CPP_DIR}): run `make install-dev`"
        )
    return os.path.abspath(LLAMA_CPP_DIR)


def build_model(case: Case):  # noqa: ANN201 - a transformers model
    """The transformers model of `case`: its variant's weights drawn as the registry draws them."""
    family = tiny_models.MODEL_FAMILY[case.variant]
    config = {**family.configs[case.variant], "vocab_size": VOCAB, **case.overrides}
    patched = dataclasses.replace(family, configs={case.variant: config})
    with mock.patch.dict(tiny_models.MODEL_FAMILY, {case.variant: patched}):
        return tiny_models.build_hf_model(case.variant)


# The cases also written at Q8_0 (row permutations, concatenations and the rotary unpermute
# over integer layouts).
Q8_0_CASES = ("qwen35", "qwen3next", "granitehybrid")


@session_cache(evict=False)  # converting every case takes ~20 s
def checkpoints() -> dict[str, tuple[str, str]]:
    """Case name -> (Hugging Face checkpoint directory, its F32 GGUF file), for every case;
    `<case>-q8_0` -> (the same directory, its Q8_0 GGUF file) for `Q8_0_CASES`."""
    root = make_tmp_dir("gguf-hybrids-")
    paths, jobs = {}, []
    for name, case in CASES.items():
        src = os.path.join(root, name)
        model = build_model(case)
        model.save_pretrained(src)
        if case.tokenizer == "llama-bytes":
            llama_byte_tokenizer(src, model.config.vocab_size)
        else:
            neox_tokenizer_cut(src, model.config.vocab_size)
        _as_released(case, src)
        if case.mtp:
            add_mtp_head(src, model.config)
        out = os.path.join(root, f"{name}.gguf")
        paths[name] = (src, out)
        jobs.append(f"{src}={out}")
        if name in Q8_0_CASES:
            q8 = os.path.join(root, f"{name}-q8_0.gguf")
            paths[f"{name}-q8_0"] = (src, q8)
            jobs.append(f"{src}={q8}=q8_0")
    script = os.path.join(os.path.dirname(__file__), "convert_checkpoints.py")
    done = subprocess.run(
        [sys.executable, script, llama_cpp_dir(), *jobs], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-4000:]}")
    return paths


def _as_released(case: Case, src: str) -> None:
    """Rewrites the saved config.json with `case.hub_keys` / `drop_keys`, and the tensor names
    with `case.tensor_names`."""
    if case.tensor_names:
        from safetensors.torch import load_file, save_file

        file = os.path.join(src, "model.safetensors")
        tensors = load_file(file)
        for old, new in case.tensor_names.items():
            tensors = {k.replace(old, new): v for k, v in tensors.items()}
        save_file(tensors, file, metadata={"format": "pt"})
    path = os.path.join(src, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(case.hub_keys)
    for key in case.drop_keys:
        config.pop(key, None)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def llama_byte_tokenizer(path: str, size: int) -> None:
    """Writes a Llama-style tokenizer of `size` tokens into `path`: BPE with byte fallback
    (`<unk>`, `<s>`, `</s>`, the 256 byte tokens `<0xNN>`, then `▁` and letters, no merges),
    SentencePiece's `▁` for spaces (none prepended), no BOS added."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz"]:
        vocab[piece] = len(vocab)
    while len(vocab) < size:
        vocab[f"▁{len(vocab)}"] = len(vocab)
    bpe = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(bpe)
    # no `▁` prepended: the converter writes Jamba's vocabulary with add_space_prefix false
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )  # fmt: skip
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False}  # fmt: skip
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


def neox_tokenizer_cut(path: str, size: int) -> None:
    """Writes the registry's GPT-NeoX tokenizer cut to its first `size` tokens into `path`:
    the merges whose parts and result are all kept, the added tokens below `size`."""
    tiny_models.copy_tokenizer(path)
    file = os.path.join(path, "tokenizer.json")
    with open(file, encoding="utf-8") as f:
        tokenizer = json.load(f)
    model = tokenizer["model"]
    model["vocab"] = {t: i for t, i in model["vocab"].items() if i < size}
    model["merges"] = [
        m for m in model["merges"]
        if all(p in model["vocab"] for p in (*m, "".join(m)))
    ]  # fmt: skip
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < size]
    with open(file, "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)


def add_mtp_head(path: str, config) -> None:  # noqa: ANN001 - a transformers config
    """Adds a Qwen3.5 MTP head (`mtp.*`, as the releases ship it) to the checkpoint at `path`:
    one decoder layer (the model's first attention layer's tensors, perturbed), `fc (H, 2H)`
    and the three zero-centred norms, drawn from a fixed seed."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(7)
    attention = config.layer_types.index("full_attention")
    for name, w in list(tensors.items()):
        if name.startswith(f"model.layers.{attention}."):
            noise = torch.randn(w.shape, generator=g) * 0.01
            tensors["mtp.layers.0." + name.split(".", 3)[3]] = w + noise
    hidden = config.hidden_size
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g) * 0.1
    save_file(tensors, file, metadata={"format": "pt"})
