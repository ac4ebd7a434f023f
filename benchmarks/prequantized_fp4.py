"""What loading an FP4 checkpoint (MXFP4, NVFP4) or an FP8 one each way costs in accuracy, on
the shipped `tiny-stdlib` model (trained weights).

The model's projections (`in_proj`, `x_proj`, `out_proj`) are written as a compressed-tensors
MXFP4 / NVFP4 checkpoint by the tests' spec writers (`tests/helpers/prequantized_checkpoints.py`);
the format's values V are then held four ways, all with float32 activations:

- as the engine loads it by default (exact: V itself): FP4 as twice the E2M1 value in int8
  codes with scales per block; FP8 (`--formats fp8-blocks`, Qwen's / DeepSeek's block-scaled
  layout) widened to the float32 model;
- dequantised to bfloat16 (V rounded to bfloat16, written as a float checkpoint);
- with `quantization="int8"` / `"int4"`: V requantised by the load-time quantiser.

For each: the largest absolute weight error against V, the relative Frobenius error
(||W - V|| / ||V||), and the held-out loss, top-1 and greedy agreement against the exact load
(`heldout_loss.evaluate`, teacher-forced over held-out windows).

    python benchmarks/prequantized_fp4.py --windows 100 [--formats ct-mxfp4,ct-nvfp4,fp8-blocks]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("in_proj.weight", "x_proj.weight", "out_proj.weight")


def write_checkpoint(src: str, dst: str, writer, config: dict | None, cast=None) -> dict:  # noqa: ANN001
    """Copies `src` to `dst` with each projection written by `writer`: as its format's tensors
    with `config`, or (config None) as float values `cast(V)`. Returns name -> V."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    out, values = {}, {}
    for name, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        if not name.endswith(LAYERS):
            out[name] = tensor
            continue
        parts, value = writer(tensor.float())
        values[name] = value
        if config is None:
            out[name] = cast(value).float().contiguous()
        else:
            base = name.removesuffix(".weight")
            out.update({f"{base}.{k}": t for k, t in parts.items()})
    save_file(out, os.path.join(dst, "model.safetensors"))
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            hf = json.load(f)
        hf["quantization_config"] = config
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(hf, f)
    del torch
    return values


def weight_errors(values: dict) -> dict[str, tuple[float, float]]:
    """Per way of holding V: (max |W - V|, ||W - V|| / ||V||) over the projections."""
    import torch

    from vllm_mamba.ops.int4_linear import dequantize_int4, quantize_int4
    from vllm_mamba.ops.int8_linear import quantize_int8

    ways = {
        "exact (as loaded by default)": lambda v: v,
        "bfloat16": lambda v: v.bfloat16().float(),
        "quantization=int8": lambda v: (lambda q, s: q.float() * s[:, None])(*quantize_int8(v)),
        "quantization=int4": lambda v: dequantize_int4(*quantize_int4(v), torch.float32),
    }
    out = {}
    for way, fn in ways.items():
        worst, num, den = 0.0, 0.0, 0.0
        for v in values.values():
            d = fn(v) - v
            worst = max(worst, d.abs().max().item())
            num, den = num + d.pow(2).sum().item(), den + v.pow(2).sum().item()
        out[way] = (worst, (num / den) ** 0.5)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default="ct-mxfp4,ct-nvfp4", help="comma-separated")
    args = p.parse_args()
    for path in (REPO_ROOT, os.path.join(REPO_ROOT, "benchmarks")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import torch
    from heldout_loss import common_prefix, evaluate, heldout_windows

    from tests.helpers.prequantized_checkpoints import FORMATS
    from vllm_mamba.model_zoo import DEFAULT_MODEL, shipped_model_path

    torch.set_num_threads(args.threads)
    src = shipped_model_path(DEFAULT_MODEL)
    wins = heldout_windows(os.path.join(src, "tokenizer.json"), args.windows)
    tmp = tempfile.mkdtemp(prefix="fp4-error-")
    base = evaluate(src, wins, dtype="float32")
    print(f"{len(wins)} windows; float32 original: loss {base['loss']:.4f}")
    for fmt in args.formats.split(","):
        spec = FORMATS[fmt]
        quant, bf16 = os.path.join(tmp, fmt), os.path.join(tmp, fmt + "-bf16")
        values = write_checkpoint(src, quant, spec.write, spec.config)
        write_checkpoint(src, bf16, spec.write, None, cast=lambda v: v.bfloat16())
        errors = weight_errors(values)
        runs = {
            "exact (as loaded by default)": evaluate(quant, wins, dtype="float32"),
            "bfloat16": evaluate(bf16, wins, dtype="float32"),
            "quantization=int8": evaluate(quant, wins, dtype="float32", quantization="int8"),
            "quantization=int4": evaluate(quant, wins, dtype="float32", quantization="int4"),
        }
        exact = runs["exact (as loaded by default)"]
        print(f"\n{fmt} (exact vs float32 original: loss {exact['loss']:.4f})")
        print("| held as | max abs weight error | relative error | held-out loss | vs exact "
              "| top-1 agreement | greedy agreement |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for way, r in runs.items():
            worst, rel = errors[way]
            same = sum(a == b for a, b in zip(r["top1"], exact["top1"])) / len(exact["top1"])
            prefix = sum(common_prefix(a, b) for a, b in zip(r["greedy"], exact["greedy"]))
            total = sum(len(g) for g in exact["greedy"])
            print(f"| {way} | {worst:.2e} | {rel:.2e} | {r['loss']:.4f} | "
                  f"{(r['loss'] / exact['loss'] - 1) * 100:+.3f}% | {same * 100:.2f}% | "
                  f"{prefix}/{total} |")  # fmt: skip
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
