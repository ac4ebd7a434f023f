"""`vllm-mamba chat [MODEL]`: an interactive terminal chat with a local model.

Each line typed is a user message; the reply streams as it is generated and joins the
history, so the conversation carries on. `/reset` clears the history (keeping `--system`),
`/exit` (or end of input, Ctrl-D) leaves. Ctrl-C during a reply stops it (the turn is dropped
from the history) and the chat goes on; Ctrl-C at the prompt leaves. The prompt is rendered
with the model's chat template, or `--chat-template`. Logs go to standard error, warnings and
errors only (`-v` for info), never inside a reply's line.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import threading
from typing import Any, TextIO

from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.entrypoints.cli_args import HelpFormatter, add_model_args, add_verbose_arg
from vllm_mamba.logger import StreamedText, log_level
from vllm_mamba.model_zoo import DEFAULT_MODEL

EXAMPLES = """examples:
  vllm-mamba chat                                   # the shipped model, offline
  vllm-mamba chat vllm-mamba/tiny-stdlib --system "Helpers for paths." --max-tokens 64
  vllm-mamba chat --model state-spaces/mamba-130m-hf --chat-template template.jinja
"""
PROMPT = "> "


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers `chat` and its arguments."""
    parser = subparsers.add_parser(
        "chat",
        usage="%(prog)s [MODEL] [options]",
        help="chat with a model in the terminal",
        description="An interactive chat: type a message, the reply streams; /reset, /exit; "
        "Ctrl-C stops a reply.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    add_model_args(parser, DEFAULT_MODEL)
    conversation = parser.add_argument_group("conversation")
    conversation.add_argument("--system", default=None, help="a system message to start with")
    conversation.add_argument(
        "--chat-template", default=None, help="chat template, file or text (default: the model's)"
    )
    add_verbose_arg(conversation)
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=128, help="tokens per reply")
    sampling.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    sampling.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    EngineArgs.add_cli_args(parser, skip=("model", "served_model_name"))
    parser.set_defaults(func=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    """Loads the model and chats on standard input and output until `/exit` or EOF."""
    from vllm_mamba import LLM, SamplingParams
    from vllm_mamba.entrypoints.chat_utils import ChatTemplate

    with log_level(args.verbose):
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
        )
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
        template = ChatTemplate(llm.get_tokenizer(), args.chat_template)
        if template.template is None:
            raise ValueError(f"{args.model} has no chat template: pass --chat-template")
        ChatSession(llm, template, params, args.system).loop(sys.stdin, sys.stdout)
    return 0


class ChatSession:
    """A conversation with one model: the history, and one streamed reply per user line."""

    def __init__(self, llm: Any, template: Any, params: Any, system: str | None) -> None:
        self.llm = llm
        self.template = template
        self.params = params
        self.system = [{"role": "system", "content": system}] if system else []
        self.history: list[dict[str, str]] = list(self.system)
        self._ids = itertools.count()

    def loop(self, stdin: TextIO, stdout: TextIO) -> None:
        """Reads lines until `/exit`, end of input or Ctrl-C at the prompt."""
        with StreamedText(stdout) as out:
            out.write("Type a message; /reset clears the history, /exit leaves.\n")
            while True:
                out.write(PROMPT)
                try:
                    line = stdin.readline()
                except KeyboardInterrupt:
                    line = ""
                if stdin.isatty():
                    out.open = False  # the terminal echoed the line typed, Enter included
                if not line or line.strip() in ("/exit", "/quit"):
                    out.write("\n")
                    return
                text = line.rstrip("\n")
                if text.strip() == "/reset":
                    self.history = list(self.system)
                    out.write("(history cleared)\n")
                elif text.strip():
                    self.reply(text, out)

    def reply(self, text: str, out: StreamedText) -> str:
        """Streams the reply to `text` onto `out` and adds both turns to the history.

        Ctrl-C (SIGINT) while it streams aborts the request between two engine steps and
        returns what came so far; that turn stays out of the history.
        """
        turns = [*self.history, {"role": "user", "content": text}]
        engine = self.llm.llm_engine
        try:
            prompt = self.template.render(turns, True)
            ids = engine.inputs.encode(prompt, add_special_tokens=False)
            request_id = f"chat-{next(self._ids)}"
            engine.add_request(request_id, {"prompt": prompt, "prompt_token_ids": ids}, self.params)
        except ValueError as err:
            out.write(f"error: {err}\n")
            return ""
        printed = ""
        with _SigintFlag() as interrupted:
            while engine.has_unfinished_requests() and not interrupted:
                for step_out in engine.step():
                    reply = step_out.outputs[0].text
                    out.write(reply[len(printed) :])
                    printed = reply
        if interrupted:
            engine.abort_request(request_id)
            out.write("\n(interrupted)\n")
            return printed
        out.write("\n")
        self.history = [*turns, {"role": "assistant", "content": printed}]
        return printed


class _SigintFlag:
    """While entered (on the main thread), SIGINT sets the flag instead of raising
    `KeyboardInterrupt`, so that a reply stops between engine steps, never inside one; the
    flag is truthy once set."""

    def __init__(self) -> None:
        self.set = False
        self._previous: Any = None

    def __bool__(self) -> bool:
        return self.set

    def __enter__(self) -> _SigintFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.set = True
