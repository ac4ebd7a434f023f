"""Converts Hugging Face checkpoint directories to F32 GGUF files with llama.cpp's converter.

Run as a script (`python convert_checkpoints.py LLAMA_CPP_DIR SRC=OUT[=OUTTYPE] ...`, F32
when no type is given) so that the
converter imports its own `gguf-py` (newer than the pip `gguf` package the tests read with):
one process converts every checkpoint given, which saves the converter's start-up per file.

Two things are set as llama.cpp's own command line would for these tiny checkpoints:
- `--no-mtp` for the models whose converter class exports multi-token prediction layers when
  the checkpoint has none (`mtp_num_hidden_layers`; the converter asserts otherwise);
- the tokenizer's pre-tokenizer name when the converter does not recognise its hash (which
  it computes from the tokens of a test text): the tiny checkpoints carry GPT-NeoX's
  vocabulary cut to a few thousand tokens, whose pre-tokenizer is NeoX's, `olmo` in
  llama.cpp's names (as it names the whole NeoX vocabulary); transformers loads it for
  Qwen3.5-MoE as `Qwen3_5Tokenizer` (Qwen's pre-tokenizer over that vocabulary), `qwen35`.
  The tensors and the model metadata are untouched.
"""

from __future__ import annotations

import importlib.util
import os
import sys

PRE_TOKENIZER_FALLBACK = {"Qwen3_5Tokenizer": "qwen35", "TokenizersBackend": "olmo"}


def main(argv: list[str]) -> None:
    root, jobs = argv[0], argv[1:]
    sys.path[:0] = [root, os.path.join(root, "gguf-py")]
    spec = importlib.util.spec_from_file_location(
        "convert_hf_to_gguf", os.path.join(root, "convert_hf_to_gguf.py")
    )
    assert spec is not None and spec.loader is not None
    converter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(converter)
    from conversion.base import TextModel  # the converter's own package, on sys.path now

    recognise = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:  # noqa: ANN001 - the converter's types
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            fallback = PRE_TOKENIZER_FALLBACK.get(type(tokenizer).__name__)
            if fallback is None:
                raise
            return fallback

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    for job in jobs:
        src, out, *outtype = job.split("=")
        args = ["convert_hf_to_gguf.py", src, "--outtype", *(outtype or ["f32"]), "--outfile", out]
        config = _config(src)
        model_class = converter.get_model_class(config["architectures"][0])
        model_class.no_mtp = False  # `--no-mtp` sets it on the class: not for the next file
        if model_class.supports_mtp_export and not config.get("mtp_num_hidden_layers"):
            args.append("--no-mtp")
        sys.argv = args
        converter.main()


def _config(src: str) -> dict:
    import json

    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        return json.load(f)


if __name__ == "__main__":
    main(sys.argv[1:])
