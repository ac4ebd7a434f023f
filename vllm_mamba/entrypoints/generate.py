"""`vllm-mamba generate [MODEL] [PROMPT ...]`: continue prompts from the command line and
report throughput.

The model is `--model MODEL`, or the first word when it is meant as one (`names_a_model`: an
existing directory, a word shaped as a path such as `./models/x`, a shipped name such as
`vllm-mamba/tiny-stdlib` or a hub id `owner/name`; one that is not there is an error, never a
prompt); every other word is a prompt. `-` as the prompt, or no prompt while standard input
is not a terminal, reads the whole of standard input as one prompt (as `ollama run` and
`llama-cli` do: `cat file.py | vllm-mamba generate MODEL`). `--system` renders each prompt as
a user message after that system message with the model's chat template (a model without one
is an error). The text goes to standard output; logs (warnings and errors, `-v` for info) to
standard error, never inside a streamed line.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.entrypoints.cli_args import (
    HelpFormatter,
    add_model_args,
    add_verbose_arg,
    names_a_model,
)
from vllm_mamba.logger import StreamedText, log_level
from vllm_mamba.model_zoo import DEFAULT_MODEL

DEFAULT_PROMPT = "def fibonacci(n):"
EXAMPLES = """examples:
  vllm-mamba generate "def fibonacci(n):" "class Stack:"       # the shipped model
  vllm-mamba generate state-spaces/mamba-130m-hf "def fib(n):" --max-tokens 64
  vllm-mamba generate "def fib(n):" --temperature 0.8 --top-k 40 --n 2 --seed 1
  vllm-mamba generate "import os" --stream --stop "\n\n"
  echo "class Foo:" | vllm-mamba generate vllm-mamba/tiny-stdlib   # stdin: one prompt
  vllm-mamba generate "def add(a, b):" --system "Helpers for numbers."
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers `generate` and its arguments."""
    parser = subparsers.add_parser(
        "generate",
        usage="%(prog)s [MODEL] [PROMPT ...] [options]",
        help="generate continuations of prompts",
        description="Generate continuations of prompts and print them with a throughput line.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "prompts",
        nargs="*",
        metavar="PROMPT",
        help="the model first when it names one, then prompts; - reads standard input "
        f"(default: standard input when it is not a terminal, else {DEFAULT_PROMPT!r})",
    )
    add_model_args(parser, DEFAULT_MODEL, positional=False)
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, help="tokens per continuation")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    sampling.add_argument(
        "--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: all)"
    )
    sampling.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="stop at this text (repeatable; not included in the output)",
    )
    sampling.add_argument("--n", type=int, default=1, help="continuations per prompt")
    output = parser.add_argument_group("prompt and output")
    output.add_argument(
        "--system",
        default=None,
        help="a system message: each prompt becomes a user message after it, rendered with "
        "the model's chat template",
    )
    output.add_argument("--stream", action="store_true", help="print tokens as they come")
    add_verbose_arg(output)
    EngineArgs.add_cli_args(parser, skip=("model", "served_model_name"))
    parser.set_defaults(func=run, parser=parser, more_positionals="prompts")


def resolve_prompts(args: argparse.Namespace, stdin: Any = None) -> list[str]:
    """Takes the model out of `args.prompts` when the first word names one (and `--model` was
    not given) and returns the prompts: standard input for `-`, or when there are none and
    standard input is not a terminal (one prompt, the whole of it), else the default."""
    stdin = sys.stdin if stdin is None else stdin
    words = list(args.prompts)
    given = getattr(args, "_model_given", None)
    if words and (words[0] == given or (given is None and names_a_model(words[0]))):
        args.model = words.pop(0)
        args.model_from_words = given is None  # taken for the model by its shape alone
    if "-" in words and words != ["-"]:
        raise ValueError("- (standard input) must be the only prompt")
    if words == ["-"] or (not words and stdin is not None and not stdin.isatty()):
        try:
            text = stdin.read()
        except (OSError, ValueError):  # closed, or not readable (as under pytest)
            text = ""
        if words or text.strip():
            return [text.removesuffix("\n")]  # the newline `echo` adds
    return words or [DEFAULT_PROMPT]


def run(args: argparse.Namespace) -> int:
    """Loads the model, generates, prints the outputs and a summary line."""
    with log_level(args.verbose):
        return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    from vllm_mamba import LLM, SamplingParams

    prompts = resolve_prompts(args)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        max_tokens=args.max_tokens,
    )
    try:
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    except FileNotFoundError as err:
        if not getattr(args, "model_from_words", False):
            raise
        raise FileNotFoundError(
            f"{err} (a first word shaped as a path or model name is the model: to use it as a "
            "prompt, give the model with --model first)"
        ) from err
    inputs = _chat_prompts(llm, prompts, args.system) if args.system else prompts
    start = time.perf_counter()
    if args.stream:
        num_tokens = _stream(llm, prompts, inputs, params)
    else:
        outputs = llm.generate(inputs, params, use_tqdm=False)
        num_tokens = 0
        for prompt, out in zip(prompts, outputs):
            shown = "" if args.system else prompt
            for completion in out.outputs:
                num_tokens += len(completion.token_ids)
                tag = f" [{completion.index}]" if params.n > 1 else ""
                print(f"--- {prompt!r}{tag}\n{shown}{completion.text}\n")
    elapsed = time.perf_counter() - start
    print(
        f"{len(prompts)} prompt(s), {num_tokens} tokens in {elapsed:.2f} s "
        f"({num_tokens / max(elapsed, 1e-9):.1f} tokens/s)"
    )
    return 0


def _chat_prompts(llm: Any, prompts: list[str], system: str) -> list[dict[str, Any]]:
    """Each prompt as a user message after the system message, rendered with the model's
    chat template.

    Raises:
        ValueError: the model has no chat template.
    """
    from vllm_mamba.entrypoints.chat_utils import ChatTemplate

    template = ChatTemplate(llm.get_tokenizer())
    if template.template is None:
        raise ValueError(
            "--system needs a chat template and this model has none: put the system text in "
            "the prompt, or use `vllm-mamba chat MODEL --chat-template FILE --system ...`"
        )
    engine = llm.llm_engine
    rendered = []
    for prompt in prompts:
        turns = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        text = template.render(turns, True)
        ids = engine.inputs.encode(text, add_special_tokens=False)
        rendered.append({"prompt": text, "prompt_token_ids": ids})
    return rendered


def _stream(llm, prompts: list[str], inputs: list, params) -> int:  # noqa: ANN001
    """Streams each prompt's first continuation to stdout as it is generated, then prints the
    other `n - 1` continuations when the request finishes; returns the tokens generated."""
    engine = llm.llm_engine
    total = 0
    counter = itertools.count()
    for prompt, engine_input in zip(prompts, inputs):
        request_id = f"cli-{next(counter)}"
        engine.add_request(request_id, engine_input, params)
        shown = prompt if engine_input is prompt else ""
        tag = " [0]" if params.n > 1 else ""
        final = None
        with StreamedText(sys.stdout) as out:
            out.write(f"--- {prompt!r}{tag}\n{shown}")
            printed = 0
            while engine.has_unfinished_requests():
                for step_out in engine.step():
                    text = step_out.outputs[0].text
                    out.write(text[printed:])
                    printed = len(text)
                    final = step_out if step_out.finished else final
            out.write("\n\n")
        for completion in final.outputs[1:] if final else []:
            print(f"--- {prompt!r} [{completion.index}]\n{shown}{completion.text}\n")
        total += sum(len(c.token_ids) for c in final.outputs) if final else 0
    return total
