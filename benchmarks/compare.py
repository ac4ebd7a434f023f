"""Side-by-side CPU speed of this engine, `transformers` and llama.cpp on one model, in one run.

Any architecture the engine supports (Mamba, Mamba2, FalconMamba, ...): transformers loads the
model with `AutoModelForCausalLM`.

Workloads (tokens/s; the medians of `--reps` repetitions, interleaved across the systems so
that the machine's noise hits them alike):

- `prefill 512`: one prompt of `--prefill-len` tokens (engine: `LLM.generate` with one output
  token; transformers: `generate(max_new_tokens=1)`; llama.cpp: `llama-bench -p 512`).
- `decode bN`: N sequences of `--prompt-len` random tokens, aggregate tokens/s of the decode
  steps only (engine: `LLMEngine.step` after every prompt has its first token; transformers:
  `generate` of T tokens minus `generate` of 1 token; llama.cpp: `llama-bench -n` for b1,
  `llama-batched-bench` S_TG for more).

Each ratio is the ratio of the medians, followed by the median of each repetition's own ratio
("paired"): the host's memory bandwidth moves in phases of seconds to minutes that every
system feels, and the paired figure compares runs a few seconds apart.

llama.cpp is optional: its tools and GGUF files come from `benchmarks/setup_llama_cpp.sh`
(`--llama-cpp-home` or `$LLAMA_CPP_HOME`); without them it is skipped with a message.
Never part of CI.

Instruction-set level: `--isa generic|avx2|avx512` forces the engine's CPU kernels to that
level (`VLLM_MAMBA_CPU_ISA`, set before `vllm_mamba` is imported) and, unless
`--llama-cpp-home` is given, runs the llama.cpp built for the same level
(`LEVEL=<level> benchmarks/setup_llama_cpp.sh` makes `/tmp/llamacpp-<level>`; without it the
default home is used and the header shows the mismatch). Without `--isa` the engine runs its
own choice and llama.cpp the `--llama-cpp-home` build (`/tmp/llamacpp`: `-march=native`). The
level of both systems is printed above the table (llama.cpp's read from its build's
CMakeCache.txt).

RWKV-7 (`make_model.py --arch rwkv7`, not in transformers: `--skip-transformers`):
`--rwkv-pth FILE` adds the `rwkv` package on the same weights in BlinkDL's layout, at the
`--dtype` (fp32 / bf16; it has no int8 for RWKV-7, so it is skipped with `--quantization`), one
sequence only (no batching: its b32 / b128 cells are empty).

Quantization: `--quantization int8` runs llama.cpp's Q8_0, `--quantization int4` (the
engine's weight-only group-wise 4-bit) Q4_0 and Q4_K_M, one llama.cpp row each.

    python benchmarks/make_model.py /tmp/mamba-130m-random
    python benchmarks/compare.py --model /tmp/mamba-130m-random
    python benchmarks/compare.py --model /tmp/mamba-130m-random --dtype bfloat16
    python benchmarks/compare.py --model /tmp/mamba-130m-random --quantization int8
    python benchmarks/compare.py --model /tmp/mamba-130m-random --quantization int4 --isa avx2
    python benchmarks/make_model.py /tmp/mamba2-130m-random --arch mamba2
    python benchmarks/compare.py --model /tmp/mamba2-130m-random --batches 1,32
    python benchmarks/make_model.py /tmp/rwkv7-0.4b-random --arch rwkv7
    python benchmarks/compare.py --model /tmp/rwkv7-0.4b-random --skip-transformers \
        --rwkv-pth /tmp/rwkv7-0.4b-random/rwkv7-0.4b-random.pth
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

from compare_systems import (
    EngineSystem,
    LlamaCppSystem,
    RwkvPackageSystem,
    TransformersSystem,
    random_prompts,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = "/tmp/mamba-130m-random"
DEFAULT_LLAMA_HOME = "/tmp/llamacpp"
# Where setup_llama_cpp.sh puts the llama.cpp of each level: <base>-avx2, <base>-avx512.
LLAMA_BASE = os.environ.get("LLAMA_CPP_BASE", DEFAULT_LLAMA_HOME)
ISA_LEVELS = ["generic", "avx2", "avx512"]
ISA_ENV = "VLLM_MAMBA_CPU_ISA"  # forces the engine's kernel level (vllm_mamba/ops/cpu_isa.py)
GGUF_TYPES = {"float32": ["f32"], "bfloat16": ["bf16", "f16"], "float16": ["f16"]}
# llama.cpp's counterparts of each quantization
QUANTIZED_GGUF_TYPES = {"int8": ["q8_0"], "int4": ["q4_0", "q4_k_m"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face model directory")
    p.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPES))
    p.add_argument(
        "--quantization",
        default=None,
        choices=sorted(QUANTIZED_GGUF_TYPES),
        help="the engine's weight quantization; llama.cpp then runs its counterparts "
        "(int8: Q8_0; int4: Q4_0 and Q4_K_M)",
    )
    p.add_argument(
        "--isa",
        default=None,
        choices=ISA_LEVELS,
        help=f"force the engine's CPU kernel level (${ISA_ENV}) and use the llama.cpp built "
        f"for it ({LLAMA_BASE}-<level>, when it exists); default: the engine's own choice",
    )
    p.add_argument(
        "--ssm-state-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the engine's conv and SSM state dtype (auto: the model dtype)",
    )
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every system")
    p.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="pin the engine's threads (`threads=N`); default: the engine follows the load "
        "(it drops a thread while a llama.cpp run of the previous repetition ends)",
    )
    p.add_argument("--reps", type=int, default=3, help="repetitions; the median is reported")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the prefill prompt")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of decode runs")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens per decode sequence")
    p.add_argument("--batches", default="1,32,128", help="decode batch sizes")
    p.add_argument("--hf-decode-tokens", type=int, default=16, help="transformers' decode length")
    p.add_argument("--hf-max-batch", type=int, default=32, help="largest transformers batch")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument(
        "--llama-cpp-home",
        default=None,
        help="bin/llama-bench, bin/llama-batched-bench and gguf/<model>-<type>.gguf live here "
        f"(default: {LLAMA_BASE}-<isa> with --isa when it exists, else $LLAMA_CPP_HOME or "
        f"{DEFAULT_LLAMA_HOME})",
    )
    p.add_argument(
        "--rwkv-pth",
        default=None,
        help="a BlinkDL RWKV-7 .pth file of the same weights: also run the `rwkv` package "
        "(float32 / bfloat16 only, one sequence)",
    )
    p.add_argument(
        "--rwkv-jit", type=int, default=1, choices=[0, 1], help="the rwkv package's RWKV_JIT_ON"
    )
    p.add_argument("--json", default=None, help="also write every sample to this file")
    return p.parse_args()


def llama_cpp_home(args: argparse.Namespace) -> str:
    """`--llama-cpp-home` if given, else the build for `--isa` if there is one, else
    `$LLAMA_CPP_HOME` or the default (native) build."""
    if args.llama_cpp_home:
        return args.llama_cpp_home
    if args.isa:
        level_home = f"{LLAMA_BASE}-{args.isa}"
        if os.path.isdir(os.path.join(level_home, "bin")):
            return level_home
        print(f"{level_home} missing (LEVEL={args.isa} benchmarks/setup_llama_cpp.sh)")
    return os.environ.get("LLAMA_CPP_HOME", DEFAULT_LLAMA_HOME)


def llama_cpp_level(home: str) -> str:
    """The x86 level of the llama.cpp in `home`, from the CMakeCache.txt of the build that
    `bin/llama-bench` links into: native, avx512 (+vnni, +bf16, +vbmi), avx2, avx, sse4.2 or
    generic; "?" when it cannot be read."""
    build_dir = os.path.dirname(os.path.dirname(os.path.realpath(f"{home}/bin/llama-bench")))
    cache = {}  # NAME:TYPE=VALUE lines -> {NAME: VALUE}
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            for line in f:
                key, eq, value = line.strip().partition("=")
                if eq and ":" in key and not key.startswith(("#", "//")):
                    cache[key.split(":", 1)[0]] = value
    except OSError:
        return "?"

    def on(option: str) -> bool:
        return cache.get(f"GGML_{option}", "OFF").upper() in ("ON", "1", "TRUE", "YES")

    if on("NATIVE"):
        return "native"
    if on("AVX512"):
        extra = [e.lower() for e in ("VNNI", "BF16", "VBMI") if on(f"AVX512_{e}")]
        return "+".join(["avx512", *extra])
    for option, level in (("AVX2", "avx2"), ("AVX", "avx"), ("SSE42", "sse4.2")):
        if on(option):
            return level
    return "generic"


def engine_level() -> str:
    """The engine's active kernel level (`vllm_mamba.ops.cpu_isa.active_level()`), or "?"
    where that module is missing or fails (printed)."""
    try:
        from vllm_mamba.ops.cpu_isa import active_level

        return str(active_level())
    except ModuleNotFoundError as e:
        if e.name != "vllm_mamba.ops.cpu_isa":
            print(f"engine ISA level unknown: {e}")
        return "?"
    except Exception as e:  # noqa: BLE001 - a benchmark reports it rather than stops
        print(f"engine ISA level unknown: {type(e).__name__}: {e}")
        return "?"


def build_systems(args: argparse.Namespace) -> list:
    """The systems to measure; llama.cpp ones only when their tools and GGUF files exist."""
    systems: list = [
        EngineSystem(
            args.model,
            args.dtype,
            max(args.batches),
            args.quantization,
            args.ssm_state_dtype,
            args.engine_threads,
        )
    ]
    if not args.skip_transformers:
        systems.append(
            TransformersSystem(args.model, args.dtype, args.hf_decode_tokens, args.hf_max_batch)
        )
    if args.rwkv_pth and args.quantization:
        print(f"rwkv package skipped: it has no {args.quantization} for RWKV-7")
    elif args.rwkv_pth:
        systems.append(RwkvPackageSystem(args.rwkv_pth, args.dtype, bool(args.rwkv_jit)))
    if args.skip_llama_cpp:
        return systems
    bin_dir = os.path.join(args.llama_cpp_home, "bin")
    tools = [os.path.join(bin_dir, t) for t in ("llama-bench", "llama-batched-bench")]
    missing = [t for t in tools if not os.access(t, os.X_OK)]
    if missing:
        print(f"llama.cpp skipped: {', '.join(missing)} not built (benchmarks/setup_llama_cpp.sh)")
        return systems
    stem = os.path.basename(os.path.normpath(args.model))
    gguf_types = QUANTIZED_GGUF_TYPES.get(args.quantization) or GGUF_TYPES[args.dtype]
    for gguf_type in gguf_types:
        gguf = os.path.join(args.llama_cpp_home, "gguf", f"{stem}-{gguf_type}.gguf")
        if os.path.exists(gguf):
            systems.append(LlamaCppSystem(bin_dir, gguf, gguf_type.upper(), args.threads))
        else:
            print(f"llama.cpp {gguf_type.upper()} skipped: {gguf} is missing")
    return systems


def workloads(args: argparse.Namespace) -> list[str]:
    return [f"prefill {args.prefill_len}"] + [f"decode b{b}" for b in args.batches]


def measure(args: argparse.Namespace, systems: list) -> dict[str, dict[str, list[float]]]:
    """`samples[system][workload]`: tokens/s of every repetition (after one warm-up)."""
    names = workloads(args)
    samples = {s.name: {w: [] for w in names} for s in systems}
    prefill = random_prompts(1, args.prefill_len, seed=1)[0]
    for system in systems:
        system.warm_up(args.prompt_len)
    for rep in range(args.reps):
        for system in systems:
            start = time.perf_counter()
            got = {names[0]: system.prefill(prefill)}
            for batch in args.batches:
                prompts = random_prompts(batch, args.prompt_len, seed=100 + batch)
                got[f"decode b{batch}"] = system.decode(prompts, args.decode_tokens)
            for name, value in got.items():
                if value is not None:
                    samples[system.name][name].append(value)
            shown = ", ".join(f"{k} {v:.1f}" for k, v in got.items() if v is not None)
            print(f"rep {rep + 1} {system.name} ({time.perf_counter() - start:.0f} s): {shown}")
            sys.stdout.flush()
    return samples


def paired(samples: dict[str, dict[str, list[float]]], engine: str, other: str, w: str) -> str:
    """` (paired R)`: the median of the repetitions' own ratios, which the host's slow and fast
    phases (minutes long, moving every system's memory bandwidth) disturb less than the ratio
    of medians; empty unless both systems ran every repetition."""
    a, b = samples[engine][w], samples[other][w]
    if len(a) != len(b) or len(a) < 2:
        return ""
    return f" (paired {statistics.median(x / y for x, y in zip(a, b)):.2f}x)"


def table(
    args: argparse.Namespace,
    samples: dict[str, dict[str, list[float]]],
    levels: dict[str, str] | None = None,
) -> str:
    """One markdown table: each system's median tokens/s and the engine's ratios vs each;
    `levels[system]`, where given, follows the system's name in the header."""
    systems = list(samples)
    engine, others = systems[0], systems[1:]
    levels = levels or {}
    named = [f"{s} [{levels[s]}]" if levels.get(s) else s for s in systems]
    head = ["workload (tok/s)", *named, *[f"engine / {o}" for o in others]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads(args):
        med = {s: statistics.median(samples[s][w]) if samples[s][w] else None for s in systems}
        cells = [w] + [f"{med[s]:.1f}" if med[s] else "—" for s in systems]
        for o in others:
            if med[engine] and med[o]:
                cells.append(f"{med[engine] / med[o]:.2f}x{paired(samples, engine, o, w)}")
            else:
                cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.isa:  # before anything imports vllm_mamba
        os.environ[ISA_ENV] = args.isa
    args.llama_cpp_home = llama_cpp_home(args)
    args.llama_cpp_level = None if args.skip_llama_cpp else llama_cpp_level(args.llama_cpp_home)
    if REPO_ROOT not in sys.path:  # run from a checkout without installing
        sys.path.insert(0, REPO_ROOT)
    import torch

    torch.set_num_threads(args.threads)
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    systems = build_systems(args)
    levels = {"engine": engine_level()}  # after the engine has loaded its kernels
    isa = f"ISA: engine {levels['engine']}"
    llama_systems = [s.name for s in systems if s.name.startswith("llama.cpp")]
    if llama_systems:
        levels.update(dict.fromkeys(llama_systems, args.llama_cpp_level))
        isa += f", llama.cpp {args.llama_cpp_level} ({args.llama_cpp_home})"
        if args.isa and not args.llama_cpp_level.startswith(args.isa):
            print(f"warning: engine forced to {args.isa}, llama.cpp is {args.llama_cpp_level}")
    samples = measure(args, systems)
    print(
        f"\n{started}, {args.dtype}{', ' + args.quantization if args.quantization else ''}, "
        f"state {args.ssm_state_dtype}, {isa}, "
        f"{args.threads} threads, medians of {args.reps} runs, "
        f"decode: {args.prompt_len}-token prompts, {args.decode_tokens} tokens "
        f"(transformers {args.hf_decode_tokens}), total {time.perf_counter() - t0:.0f} s, "
        f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print(table(args, samples, levels))
    for system in systems:
        for line in system.notes():
            print(f"- {system.name}: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"date": started, "args": vars(args), "levels": levels, "samples": samples},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
