"""`vllm-mamba models`: the models that ship in the package, and the models in the local
Hugging Face cache whose architecture this engine supports (no network)."""

from __future__ import annotations

import argparse
import os

from vllm_mamba.model_zoo import list_shipped_models


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers `models`."""
    parser = subparsers.add_parser(
        "models",
        help="list the shipped models and the supported models in the hub cache",
        description="List the shipped models and the supported models in the local hub cache.",
    )
    parser.add_argument("--cache-dir", default=None, help="hub cache (default: HF_HUB_CACHE)")
    parser.set_defaults(func=run, parser=parser)


def cached_models(cache_dir: str | None = None) -> list[tuple[str, str]]:
    """`(repo id, architecture)` of every cached model whose architecture is supported."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    from vllm_mamba.models.registry import ModelRegistry

    try:
        cache = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    supported = set(ModelRegistry.get_supported_archs())
    found = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            arch = _architecture(revision.snapshot_path)
            if arch in supported:
                found.append((repo.repo_id, arch))
                break
    return found


def _architecture(snapshot: os.PathLike) -> str | None:
    """The first architecture named by a snapshot's `config.json`, if any.

    A config of another checkpoint format (the original mamba-ssm one has no
    `architectures`) counts as what its format converts it to.
    """
    from vllm_mamba.models.formats import HF_FORMAT, detect_format, read_config_json

    try:
        raw = read_config_json(str(snapshot))
    except (OSError, ValueError):
        return None
    if raw is None:
        return None
    fmt = detect_format(str(snapshot), raw)
    if fmt is not HF_FORMAT:
        return fmt.load_config(str(snapshot), raw).architectures[0]
    archs = raw.get("architectures")
    return archs[0] if archs else None


def run(args: argparse.Namespace) -> int:
    """Prints the two lists."""
    print("Shipped with the package (no download):")
    for name in list_shipped_models():
        print(f"  {name}")
    print("In the local Hugging Face cache:")
    found = cached_models(args.cache_dir)
    for repo_id, arch in found:
        print(f"  {repo_id}  ({arch})")
    if not found:
        print("  (none with a supported architecture)")
    return 0
