"""transformers 5.24's `Lfm2VlProcessor` as the LFM2-VL tests' reference, run in a child process.

transformers' LFM2-VL image processor exists only as a torchvision backend, and the venv has no
torchvision (PyPI's wheel is a CUDA build that does not import with the CPU torch). The
reference therefore runs in a child process: with torchvision when it imports there, else with
a stand-in package (`SHIM`) holding torchvision 0.28's tensor `resize` and `normalize` (the two
functions the LFM2-VL path calls), so everything else (smart resize, tiling, thumbnails,
patchification, padding, the token expansion) is transformers' own code.

`run_reference` builds the processor from a tokenizer (plus marker tokens) and image-processor
settings, saves it (`Lfm2VlProcessor.save_pretrained`: `processor_config.json` and the
tokenizer's files) and returns its outputs for each call: a prompt with its images.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import torch

from tests.helpers.tmp_dirs import make_tmp_dir

# A stand-in torchvision for transformers' torchvision backend: torchvision 0.28's tensor
# kernels of the functions the LFM2-VL path calls (`resize_image`, `normalize_image`), and
# the names transformers imports.
SHIM = {
    "torchvision-0.28.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: torchvision\n"
    "Version: 0.28.0\n",
    "torchvision/__init__.py": "__version__ = '0.28.0'\nfrom . import io, transforms\n",
    "torchvision/io.py": """
        import enum

        class ImageReadMode(enum.Enum):
            UNCHANGED = 0
            GRAY = 1
            GRAY_ALPHA = 2
            RGB = 3
            RGB_ALPHA = 4

        def decode_image(*args, **kwargs):
            raise NotImplementedError("stand-in torchvision")
        """,
    "torchvision/transforms/__init__.py": """
        from .functional import InterpolationMode
        from . import v2
        """,
    "torchvision/transforms/functional.py": """
        import enum

        import numpy as np
        import torch

        class InterpolationMode(enum.Enum):
            NEAREST = "nearest"
            NEAREST_EXACT = "nearest-exact"
            BILINEAR = "bilinear"
            BICUBIC = "bicubic"
            BOX = "box"
            HAMMING = "hamming"
            LANCZOS = "lanczos"

        def pil_to_tensor(pic):
            array = np.array(pic, copy=True)
            array = array[:, :, None] if array.ndim == 2 else array
            return torch.from_numpy(array).permute(2, 0, 1).contiguous()
        """,
    "torchvision/transforms/v2/__init__.py": "from . import functional\n",
    "torchvision/transforms/v2/functional.py": """
        import platform

        import torch
        from torch.nn.functional import interpolate

        from ..functional import InterpolationMode

        def _native_uint8(interpolation):
            if interpolation == InterpolationMode.BILINEAR:
                capability = torch.backends.cpu.get_cpu_capability()
                machine = platform.machine()
                return capability in ("AVX2", "AVX512") or machine in ("aarch64", "arm64")
            return interpolation in (InterpolationMode.BICUBIC, InterpolationMode.LANCZOS)

        def resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None,
                   antialias=True):
            assert isinstance(image, torch.Tensor) and len(size) == 2 and max_size is None
            antialias = False if antialias is None else antialias
            align_corners = None
            if interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
                align_corners = False
            else:
                antialias = False
            shape = image.shape
            numel = image.numel()
            num_channels, old_height, old_width = shape[-3:]
            new_height, new_width = (int(v) for v in size)
            if (new_height, new_width) == (old_height, old_width):
                return image
            if numel == 0:
                return image.reshape(shape[:-3] + (num_channels, new_height, new_width))
            dtype = image.dtype
            acceptable_dtypes = [torch.float32, torch.float64]
            if interpolation in (InterpolationMode.NEAREST, InterpolationMode.NEAREST_EXACT):
                acceptable_dtypes.append(torch.uint8)
            elif image.device.type == "cpu" and _native_uint8(interpolation):
                acceptable_dtypes.append(torch.uint8)
            image = image.reshape(-1, num_channels, old_height, old_width)
            strides = image.stride()
            if (image.is_contiguous(memory_format=torch.channels_last)
                    and image.shape[0] == 1 and numel != strides[0]):
                new_strides = list(strides)
                new_strides[0] = numel
                image = image.as_strided((1, num_channels, old_height, old_width), new_strides)
            need_cast = dtype not in acceptable_dtypes
            if need_cast:
                image = image.to(dtype=torch.float32)
            image = interpolate(image, size=[new_height, new_width], mode=interpolation.value,
                                align_corners=align_corners, antialias=antialias)
            if need_cast:
                if interpolation == InterpolationMode.BICUBIC and dtype == torch.uint8:
                    image = image.clamp_(min=0, max=255)
                if dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
                    image = image.round_()
                image = image.to(dtype=dtype)
            return image.reshape(shape[:-3] + (num_channels, new_height, new_width))

        def normalize(image, mean, std, inplace=False):
            if not image.is_floating_point():
                raise TypeError(f"Input tensor should be a float tensor. Got {image.dtype}.")
            mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device)
            std = torch.as_tensor(std, dtype=image.dtype, device=image.device)
            if mean.ndim == 1:
                mean = mean.view(-1, 1, 1)
            if std.ndim == 1:
                std = std.view(-1, 1, 1)
            image = image.sub_(mean) if inplace else image.sub(mean)
            return image.div_(std)

        def __getattr__(name):
            raise AttributeError(f"stand-in torchvision has no transforms.v2.functional.{name}")
        """,
}

# The child: the transformers processor saved to `save_to`, and its outputs for every call
# (`key`, prompt, image names, processor kwargs) in `outputs.pt`, by `tuple(key)`.
REFERENCE = """
import importlib, json, os, sys, warnings

work = sys.argv[1]
try:
    import torchvision
    import torchvision.transforms.v2.functional
    backend = "torchvision " + torchvision.__version__
except Exception:
    for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
        del sys.modules[name]
    sys.path.insert(0, os.path.join(work, "shim"))
    importlib.invalidate_caches()
    backend = "stand-in torchvision"
warnings.filterwarnings("ignore")
import torch

torch.set_num_threads(1)  # the same values; faster for these small tensors
from PIL import Image
import transformers

spec = json.load(open(os.path.join(work, "spec.json")))
tokenizer = transformers.AutoTokenizer.from_pretrained(spec["tokenizer"])
if spec["markers"]:
    tokenizer.add_special_tokens({"additional_special_tokens": spec["markers"]})
image_processor = transformers.Lfm2VlImageProcessor(**spec["settings"])
processor = transformers.Lfm2VlProcessor(image_processor, tokenizer)
processor.save_pretrained(spec["save_to"])
outputs = {"backend": backend}
for key, prompt, names, kwargs in spec["calls"]:
    images = []
    for name in names:
        image = Image.open(os.path.join(work, name + ".png"))
        image.load()
        images.append(image)
    out = processor(images=images, text=prompt, return_tensors="pt", **kwargs)
    outputs[tuple(key)] = {
        "input_ids": out["input_ids"][0].tolist(),
        "pixel_values": out["pixel_values"],
        "spatial_shapes": out["spatial_shapes"],
        "pixel_attention_mask": out["pixel_attention_mask"],
    }
torch.save(outputs, os.path.join(work, "outputs.pt"))
"""


def run_reference(
    tokenizer: str,
    settings: dict[str, Any],
    calls: dict[tuple, tuple[str, list[str], dict[str, Any]]],
    images: dict[str, Any],
    *,
    markers: list[str] | tuple[str, ...] = (),
    save_to: str | None = None,
) -> dict:
    """transformers' `Lfm2VlProcessor` outputs, from a child process (see the module docstring).

    Args:
        tokenizer: the directory of the tokenizer the processor wraps.
        settings: `Lfm2VlImageProcessor`'s keyword arguments.
        calls: `key -> (prompt, image names, processor kwargs)`; one processor call each.
        images: the PIL images by name (saved as PNG, which keeps their pixels).
        markers: special tokens added to the tokenizer first (`<image>`, the tile markers ...).
        save_to: where `save_pretrained` writes the processor (default: a `model` directory
            beside the child's files).

    Returns:
        `key -> {"input_ids": [...], "pixel_values", "spatial_shapes", "pixel_attention_mask"}`
        for each call, `"backend"` (torchvision or the stand-in) and `"model_dir"` (`save_to`).
    """
    work = make_tmp_dir("lfm2-vl-reference-")
    for path, text in SHIM.items():
        full = os.path.join(work, "shim", path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(textwrap.dedent(text).lstrip())
    for name, image in images.items():
        image.save(os.path.join(work, name + ".png"))
    save_to = save_to or os.path.join(work, "model")
    spec = {
        "tokenizer": tokenizer,
        "markers": list(markers),
        "settings": settings,
        "save_to": save_to,
        "calls": [[list(key), *call] for key, call in calls.items()],
    }
    with open(os.path.join(work, "spec.json"), "w") as f:
        json.dump(spec, f)
    script = os.path.join(work, "reference.py")
    with open(script, "w") as f:
        f.write(REFERENCE)
    done = subprocess.run(
        [sys.executable, script, work], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    outputs = torch.load(os.path.join(work, "outputs.pt"), weights_only=False)
    outputs["model_dir"] = save_to
    return outputs
