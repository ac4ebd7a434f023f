"""`vllm-mamba generate`: continue prompts from the command line and report throughput."""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.errors import STARTUP_ERRORS
from vllm_mamba.model_zoo import DEFAULT_MODEL

EXAMPLES = """examples:
  vllm-mamba generate "def fibonacci(n):" "class Stack:"
  vllm-mamba generate "def fib(n):" --max-tokens 64 --temperature 0.8 --n 2 --seed 1
  vllm-mamba generate "import os" --stream
  vllm-mamba generate "Hello" --model state-spaces/mamba-130m-hf
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the examples' line breaks."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers `generate` and its arguments."""
    parser = subparsers.add_parser(
        "generate",
        help="generate continuations of prompts",
        description="Generate continuations of prompts and print them with a throughput line.",
        epilog=EXAMPLES,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "prompts", nargs="*", default=["def fibonacci(n):"], help="prompts (default: a def line)"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model dir, hub id or shipped name")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, help="tokens per continuation")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    sampling.add_argument("--n", type=int, default=1, help="continuations per prompt")
    sampling.add_argument("--stream", action="store_true", help="print tokens as they come")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    """Loads the model, generates, prints the outputs and a summary line."""
    from vllm_mamba import LLM, SamplingParams

    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
        )
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    except STARTUP_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.stream:
        num_tokens = _stream(llm, args.prompts, params)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
        num_tokens = 0
        for out in outputs:
            for completion in out.outputs:
                num_tokens += len(completion.token_ids)
                tag = f" [{completion.index}]" if params.n > 1 else ""
                print(f"--- {out.prompt!r}{tag}\n{out.prompt}{completion.text}\n")
    elapsed = time.perf_counter() - start
    print(
        f"{len(args.prompts)} prompt(s), {num_tokens} tokens in {elapsed:.2f} s "
        f"({num_tokens / max(elapsed, 1e-9):.1f} tokens/s)"
    )
    return 0


def _stream(llm, prompts: list[str], params) -> int:  # noqa: ANN001 - LLM, SamplingParams
    """Streams each prompt's first continuation to stdout as it is generated, then prints the
    other `n - 1` continuations when the request finishes; returns the tokens generated."""
    engine = llm.llm_engine
    total = 0
    counter = itertools.count()
    for prompt in prompts:
        request_id = f"cli-{next(counter)}"
        engine.add_request(request_id, prompt, params)
        tag = " [0]" if params.n > 1 else ""
        print(f"--- {prompt!r}{tag}\n{prompt}", end="", flush=True)
        printed = 0
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                print(text[printed:], end="", flush=True)
                printed = len(text)
                final = out if out.finished else final
        print("\n")
        for completion in final.outputs[1:] if final else []:
            print(f"--- {prompt!r} [{completion.index}]\n{prompt}{completion.text}\n")
        total += sum(len(c.token_ids) for c in final.outputs) if final else 0
    return total
