"""Where a model name points: the one resolution every entry point uses (`LLM`, `serve`,
`generate`, `chat`, `bench`, and the tokenizer of `bench serve`).

A local directory or `.gguf` file as is; a shipped name (`vllm-mamba/NAME`) from the package;
a path that is not there is an error; anything else is a hub id, fetched through
`huggingface_hub`, which honours `HF_HOME` / `HF_HUB_CACHE` and `HF_HUB_OFFLINE=1` (then only
the local cache is looked at). A hub id that cannot be had (offline, no network, not on the
hub) fails at once, in one line. Light on purpose: no torch, no transformers.
"""

from __future__ import annotations

import os

from vllm_mamba.model_zoo import shipped_model_path

MODEL_FILES = ["*.json", "*.safetensors", "*.bin", "*.txt", "*.model", "*.py"]
TOKENIZER_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.py"]


def looks_like_path(model: str) -> bool:
    """True when `model` can only be a filesystem path, never a hub id (`org/name`)."""
    return (
        model.startswith(("/", ".", "~"))
        or model.endswith(os.sep)
        or os.sep in model.strip(os.sep).replace(os.sep, "", 1)
        or (os.altsep is not None and os.altsep in model)
    )


def resolve_model_path(
    model: str,
    revision: str | None = None,
    download_dir: str | None = None,
    allow_patterns: list[str] | None = None,
) -> str:
    """The local directory (or GGUF file) of `model`.

    Args:
        model: a directory, a `.gguf` file, a shipped name or a hub id.
        revision: the hub revision (branch, tag or commit).
        download_dir: the hub cache directory to use instead of the default.
        allow_patterns: the files fetched from the hub (default: `MODEL_FILES`).

    Raises:
        FileNotFoundError: not a directory, not shipped, and not to be had from the hub or its
            cache (the message is one line).
    """
    if os.path.isdir(model) or (model.endswith(".gguf") and os.path.isfile(model)):
        return model  # a directory, or a GGUF file (vllm_mamba.gguf)
    shipped = shipped_model_path(model)
    if shipped is not None:
        return shipped
    if os.path.exists(model):
        hint = (
            " (for a BlinkDL RWKV .pth, the directory holding it)" if model.endswith(".pth") else ""
        )
        raise FileNotFoundError(f"model {model!r} is a file; expected a model directory{hint}")
    if looks_like_path(model):
        what = "GGUF file" if model.endswith(".gguf") else "model directory"
        raise FileNotFoundError(f"{what} {model!r} does not exist")
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(
            repo_id=model,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=allow_patterns or MODEL_FILES,
        )
    except Exception as err:  # noqa: BLE001 - any hub failure means the model is not there
        raise FileNotFoundError(
            f"model {model!r} is not a local directory, a shipped model or in the Hugging Face "
            f"cache, and {_hub_failure(err, constants.HF_HUB_OFFLINE)}"
        ) from err


def _hub_failure(err: Exception, offline: bool) -> str:
    """Why the hub did not give the model, in a few words on one line."""
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    if offline:
        return "the hub is off (HF_HUB_OFFLINE=1)"
    if isinstance(err, RepositoryNotFoundError):
        return "the hub has no such model (or it is private: log in with `hf auth login`)"
    cause = err.__cause__ or err.__context__
    if isinstance(err, LocalEntryNotFoundError) and cause is not None:
        err = cause  # the connection error under huggingface_hub's paragraph
    text = " ".join(str(err).split())
    return f"the hub could not be reached: {type(err).__name__}: {text[:200]}"
