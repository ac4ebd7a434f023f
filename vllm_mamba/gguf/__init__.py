"""GGUF files (llama.cpp's format): read as a checkpoint format, their blocks kept quantised.

- `reader`: one file or a split set; metadata and memory-mapped tensors in PyTorch order.
- `blocks`: each block type decoded into the engine's exact integer layout (or float).
- `arch` and `archs/`: per `general.architecture`, the config and the tensor names back.
- `metadata`: the helpers the architecture mappings share.
- `tokenizer`: the file's tokenizer (byte-level BPE, SentencePiece, RWKV World).
- `format`: the `CheckpointFormat` the loader sees (`LLM(model="file.gguf")`).
"""
