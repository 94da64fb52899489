"""`mtad-edge chat`: a streaming multi-turn chat in the terminal.

The engine keeps the KV cache of the conversation so far, so each turn prefills only what is new.
Ctrl-C stops the current answer and keeps the chat; Ctrl-D (end of input) leaves.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import click

from mtad_edge.cli.options import (
    ModelChoice,
    decode_config,
    decode_options,
    errors_as_click,
    given,
    model_options,
    recommended_note,
    stdout_error,
    write_out,
)
from mtad_edge.engine import check_text
from mtad_edge.runtime.errors import ContextOverflowError, MtadEdgeError, OptionError
from mtad_edge.runtime.methods import names as method_names
from mtad_edge.signals import interrupts

HELP = (
    "/reset clears the conversation, /stats shows the last answer's stats, /method NAME switches "
    f"decoder ({', '.join(method_names())}), /json toggles JSON mode (each answer a JSON object), /help, "
    "/quit. Ctrl-C stops an answer, Ctrl-D quits."
)
JSON_MODE = {"type": "json_object"}  # /json: OpenAI's JSON mode


def _info(msg: str) -> None:
    click.echo(msg, err=True)


_EMPTY_TURN = [{"role": "user", "content": ""}]


class ChatSession:
    """The conversation and its commands; ``turn`` streams one answer to ``out``."""

    def __init__(self, engine, method: str, system: str | None, drop_oldest: bool, out=None):
        self.engine, self.method = engine, method
        self.out = out or sys.stdout  # looked up now, not at import: tests and redirections swap it
        self.system = [{"role": "system", "content": system}] if system else []
        # the system message with an empty first turn, in tokens: what --system costs every turn
        self.system_tokens = len(engine.tokenize(engine.render_chat(self.system + _EMPTY_TURN))) if system else 0
        self.drop_oldest = drop_oldest
        self.turns: list[dict] = []
        self.last_stats = None
        self.json_mode = False

    def command(self, line: str) -> bool:
        """Handle a /command; False means quit."""
        cmd, _, arg = line.strip().partition(" ")
        if arg.strip() and cmd in ("/quit", "/exit", "/reset", "/stats", "/help"):  # "/reset all" is not "/reset"
            _info(f"({cmd} takes nothing after it; nothing done)")
            return True
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/reset":
            self.turns = []
            _info("(conversation cleared)")
        elif cmd == "/stats":
            _info(self.last_stats.summary() if self.last_stats else "(no answer yet)")
        elif cmd == "/method":
            name, choices = arg.strip(), ", ".join(method_names())
            if name in method_names():
                self.method = name
                _info(f"(method: {self.method})")
            elif name:
                _info(f"(no method {name!r}; still {self.method}; choose from {choices})")
            else:
                _info(f"(method is {self.method}; choose from {choices})")
        elif cmd == "/json":
            self.json_mode = not self.json_mode
            _info("(JSON mode: each answer is a JSON object)" if self.json_mode else "(JSON mode off)")
        elif cmd == "/help":
            _info(HELP)
        else:
            _info(f"(unknown command {cmd}; /help lists them)")
        return True

    def _response(self):
        """Start the answer; drop the oldest turns if allowed and the context is full."""
        while True:
            try:
                fmt = JSON_MODE if self.json_mode else None
                return self.engine.chat(self.system + self.turns, method=self.method, response_format=fmt)
            except ContextOverflowError as e:
                if not self.drop_oldest or len(self.turns) <= 1:
                    earlier = len(self.turns) > 1  # else the line alone (with --system) overflows: no turn to drop
                    self.turns.pop()
                    hint = " Use /reset, or start the chat with --drop-oldest." if earlier else ""
                    if self.system_tokens and not earlier:
                        hint = f" The --system message takes {self.system_tokens} of those tokens."
                    _info(f"context full: {e}.{hint}")
                    return None
                del self.turns[:2]  # the oldest user message and its answer
                _info("(dropped the oldest turn to fit the context)")
            except OptionError as e:  # the line itself was refused (not UTF-8 text): the chat goes on
                self.turns.pop()
                _info(f"(not sent: {e})")
                return None

    def turn(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})
        response = self._response()
        if response is None:
            return
        said = []
        try:
            with interrupts.stopping(response.cancel):  # Ctrl-C (console script): ends at the next step
                for piece in response:
                    said.append(piece)
                    write_out(piece, self.out)
        except KeyboardInterrupt:  # Python's own Ctrl-C, where the console script's is not installed
            response.close()
        stopped = response.finish_reason == "cancelled" or interrupts.received
        write_out(" [stopped]\n" if stopped else "\n", self.out)
        self.turns.append({"role": "assistant", "content": "".join(said)})
        self.last_stats = response.stats


@click.command()
@model_options
@decode_options
@click.option("--system", help="System message for the conversation.")
@click.option(
    "--drop-oldest", is_flag=True, help="When the context is full, drop the oldest turns instead of refusing."
)
@errors_as_click
def chat(model: ModelChoice, system: str | None, drop_oldest: bool, **decode: Any) -> None:
    """Chat with the model in the terminal (the pair's chat template, streaming answers)."""
    cfg = decode_config(**decode)
    if system is not None:
        check_text(system, "system", "--system")  # before the load: it is part of every turn
    interrupts.hold()  # a signal during the load ends the command once it is loaded
    engine = model.engine(cfg, given=given(decode))
    if interrupts.code:
        engine.close()
        return
    interrupts.handled()  # from here Ctrl-C at the prompt raises KeyboardInterrupt, as usual
    method = cfg.method
    try:
        session = ChatSession(engine, method, system, drop_oldest)
        if system:  # a request made and not read does no work; one that cannot start raises here
            try:
                engine.chat(session.system + _EMPTY_TURN, method=method)
            except ContextOverflowError as e:
                raise MtadEdgeError(
                    f"--system takes {session.system_tokens} tokens, so no turn would fit: {e}"
                ) from None
        # bytes that are not text reach the turn (one line refused), not the reader
        if hasattr(sys.stdin, "reconfigure"):
            sys.stdin.reconfigure(errors="surrogateescape")
        _info(f"mtad-edge chat ({model.label}, method {method}{recommended_note(engine.recommended)}). {HELP}")
        while True:
            try:
                line = input("> ")
            except OSError as e:  # its prompt goes to standard output: a full disk, a closed pipe
                raise stdout_error(e) from None
            except EOFError:
                click.echo()
                break
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line
                click.echo()
                line = ""
            if signal.SIGTERM in interrupts.received:
                break
            interrupts.handled()
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not session.command(line):
                    break
                continue
            session.turn(line)
            if signal.SIGTERM in interrupts.received:
                break
            interrupts.handled()
    finally:
        interrupts.hold()  # the models are freed without interruption
        engine.close()
    interrupts.hard_exit = True
