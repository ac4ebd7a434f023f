"""`ModelRegistry`: maps `config.json` architecture names to model classes, and model types
transformers has no config class for to ours, both imported lazily.

Out-of-tree models plug in with `ModelRegistry.register_model("MyArch", "pkg.module:MyClass")`
or with the class itself, and their config class with
`ModelRegistry.register_config("my_type", "pkg.module:MyConfig")`. Checkpoint formats other
than Hugging Face's are registered in `vllm_mamba.models.formats`.
"""

from __future__ import annotations

import importlib

_BUILTIN_MODELS: dict[str, str] = {
    "MambaForCausalLM": "vllm_mamba.models.mamba:MambaForCausalLM",
    "FalconMambaForCausalLM": "vllm_mamba.models.falcon_mamba:FalconMambaForCausalLM",
    "Mamba2ForCausalLM": "vllm_mamba.models.mamba2:Mamba2ForCausalLM",
    "JambaForCausalLM": "vllm_mamba.models.jamba:JambaForCausalLM",
    "BambaForCausalLM": "vllm_mamba.models.bamba:BambaForCausalLM",
    "GraniteMoeHybridForCausalLM": (
        "vllm_mamba.models.granitemoehybrid:GraniteMoeHybridForCausalLM"
    ),
    "NemotronHForCausalLM": "vllm_mamba.models.nemotron_h:NemotronHForCausalLM",
    "FalconH1ForCausalLM": "vllm_mamba.models.falcon_h1:FalconH1ForCausalLM",
    "Zamba2ForCausalLM": "vllm_mamba.models.zamba2:Zamba2ForCausalLM",
    "ZambaForCausalLM": "vllm_mamba.models.zamba:ZambaForCausalLM",
    "ZayaForCausalLM": "vllm_mamba.models.zaya:ZayaForCausalLM",
    "Qwen3_5ForCausalLM": "vllm_mamba.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "vllm_mamba.models.qwen3_5:Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration": "vllm_mamba.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration": (
        "vllm_mamba.models.qwen3_5:Qwen3_5MoeForConditionalGeneration"
    ),
    "Qwen3NextForCausalLM": "vllm_mamba.models.qwen3_next:Qwen3NextForCausalLM",
    "OlmoHybridForCausalLM": "vllm_mamba.models.olmo_hybrid:OlmoHybridForCausalLM",
    "KimiLinearForCausalLM": "vllm_mamba.models.kimi_linear:KimiLinearForCausalLM",
    "BailingHybridForCausalLM": "vllm_mamba.models.bailing_hybrid:BailingHybridForCausalLM",
    "Glm5NextForConditionalGeneration": (
        "vllm_mamba.models.glm5_next:Glm5NextForConditionalGeneration"
    ),
    "Qwen4ExpForCausalLM": "vllm_mamba.models.qwen4_exp:Qwen4ExpForCausalLM",
    "Qwen4ExpForConditionalGeneration": (
        "vllm_mamba.models.qwen4_exp:Qwen4ExpForConditionalGeneration"
    ),
    "LaraMiniForCausalLM": "vllm_mamba.models.lara_mini:LaraMiniForCausalLM",
    "Lfm2ForCausalLM": "vllm_mamba.models.lfm2:Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM": "vllm_mamba.models.lfm2:Lfm2MoeForCausalLM",
    "Lfm2VlForConditionalGeneration": "vllm_mamba.models.lfm2_vl:Lfm2VlForConditionalGeneration",
    "Lfm3ForCausalLM": "vllm_mamba.models.lfm3:Lfm3ForCausalLM",
    "Lfm3VlForConditionalGeneration": "vllm_mamba.models.lfm3_vl:Lfm3VlForConditionalGeneration",
    "MiniMaxForCausalLM": "vllm_mamba.models.minimax:MiniMaxForCausalLM",
    "RecurrentGemmaForCausalLM": "vllm_mamba.models.recurrent_gemma:RecurrentGemmaForCausalLM",
    "xLSTMForCausalLM": "vllm_mamba.models.xlstm:XLSTMForCausalLM",
    "InklingForCausalLM": "vllm_mamba.models.inkling:InklingForCausalLM",
    "InklingForConditionalGeneration": "vllm_mamba.models.inkling:InklingForConditionalGeneration",
    "Inkling2ForCausalLM": "vllm_mamba.models.inkling2:Inkling2ForCausalLM",
    "Inkling2ForConditionalGeneration": (
        "vllm_mamba.models.inkling2:Inkling2ForConditionalGeneration"
    ),
    "Inkling2LoopForCausalLM": "vllm_mamba.models.inkling2_loop:Inkling2LoopForCausalLM",
    "Inkling2LoopForConditionalGeneration": (
        "vllm_mamba.models.inkling2_loop:Inkling2LoopForConditionalGeneration"
    ),
    "RWKV7ForCausalLM": "vllm_mamba.models.rwkv7:RWKV7ForCausalLM",
    "RwkvForCausalLM": "vllm_mamba.models.rwkv4:RwkvForCausalLM",
}

# model types transformers has no config class for: ours
_BUILTIN_CONFIGS: dict[str, str] = {
    "rwkv7": "vllm_mamba.models.rwkv7:Rwkv7Config",
}


def _import(reference: str) -> type:
    module_name, cls_name = reference.split(":")
    return getattr(importlib.import_module(module_name), cls_name)


class _ModelRegistry:
    """Architecture name -> class, or a lazy `"module:Class"` reference to one; model type ->
    config class (or reference)."""

    def __init__(self) -> None:
        self._models: dict[str, type | str] = dict(_BUILTIN_MODELS)
        self._configs: dict[str, type | str] = dict(_BUILTIN_CONFIGS)

    def register_model(self, arch: str, model_cls: type | str) -> None:
        """Registers (or replaces) the class serving architecture `arch`.

        Args:
            arch: the name in `config.json`'s `architectures`.
            model_cls: the class, or `"package.module:ClassName"` to import on first use.
        """
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(f"model_cls {model_cls!r} must look like 'package.module:ClassName'")
        self._models[arch] = model_cls

    def register_config(self, model_type: str, config_cls: type | str) -> None:
        """Registers (or replaces) the config class of `model_type` (a `config.json`'s
        `model_type` that transformers does not know); it is registered with `AutoConfig`
        when a checkpoint of that type is read.

        Args:
            config_cls: a `PretrainedConfig` subclass, or `"package.module:ClassName"`.
        """
        if isinstance(config_cls, str) and ":" not in config_cls:
            raise ValueError(f"config_cls {config_cls!r} must look like 'package.module:ClassName'")
        self._configs[model_type] = config_cls

    def resolve_config_cls(self, model_type: str) -> type | None:
        """Our config class of `model_type`; None when it is not ours (transformers' own)."""
        entry = self._configs.get(model_type)
        if isinstance(entry, str):
            entry = self._configs[model_type] = _import(entry)
        return entry

    def get_supported_archs(self) -> list[str]:
        """All registered architecture names, sorted."""
        return sorted(self._models)

    def resolve_model_cls(self, architectures: list[str] | str) -> tuple[type, str]:
        """The class for the first supported name in `architectures`.

        Raises:
            ValueError: none is supported (the message lists the supported ones).
        """
        names = [architectures] if isinstance(architectures, str) else list(architectures or [])
        for arch in names:
            if arch in self._models:
                return self._load(arch), arch
        raise ValueError(
            f"Model architectures {names} are not supported. "
            f"Supported architectures: {', '.join(self.get_supported_archs())}"
        )

    def _load(self, arch: str) -> type:
        entry = self._models[arch]
        if isinstance(entry, str):
            entry = self._models[arch] = _import(entry)
        return entry


ModelRegistry = _ModelRegistry()
