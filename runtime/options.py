"""Every request option, written once: its default, its bound and its error message.

The runtime's configs (``SamplingConfig``, ``DecodeConfig``) validate with :func:`check`; the CLI
builds its click options from :data:`OPTIONS` (mtad_edge/cli/options.py) and the server parses
request bodies with :func:`check` too, so the same bad value gets the same words everywhere:

    >>> check("gamma", 0)
    Traceback (most recent call last):
    OptionError: gamma must be an integer in 1..16 or 'auto', got 0
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from .drafting import choices as drafter_choices
from .drafting.base import AUTO, AUTO_WIDTH_MAX
from .errors import OptionError, quoted
from .methods import names as method_names

__all__ = ["AUTO", "AUTO_WIDTH_MAX", "OPTIONS", "RECOMMENDED", "Option", "check", "default"]


@dataclass(frozen=True)
class Option:
    """One option. ``kind``: "int", "float", "choice" or "strings"; ``lo``/``hi`` bound numbers
    (``lo_open``: lo itself excluded); ``auto``: the string "auto" is accepted too; ``nullable``:
    None means "unset" (e.g. a random seed); ``choices`` lists the allowed strings; ``recommended``:
    a model may set its default."""

    name: str
    kind: str
    default: Any
    help: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    auto: bool = False
    nullable: bool = False
    choices: Optional[Callable[[], tuple[str, ...]]] = None
    max_items: int = 0  # strings: how many at most (0 = any)
    max_chars: int = 0  # strings: how many characters in all, at most (0 = any)
    # A model may recommend this option's default (a pair's manifest "defaults", a GGUF's
    # general.sampling.*): the table's default applies only where it does not.
    recommended: bool = False

    def describe(self) -> str:
        """What a valid value is, in words (used in every error message and in --help)."""
        if self.kind == "choice":
            return "one of " + ", ".join(self.allowed())
        if self.kind == "strings":
            limit = f" ({self.max_chars} characters in all)" if self.max_chars else ""
            return "a string or a list of " + (f"up to {self.max_items} " if self.max_items else "") + "strings" + limit
        noun = "an integer" if self.kind == "int" else "a number"
        if self.lo is not None and self.hi is not None:
            if self.kind == "int":
                rng = f" in {self.lo:g}..{self.hi:g}"
            else:
                rng = f" in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        elif self.lo is not None:
            rng = f" {'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            rng = ""
        return noun + rng + (" or 'auto'" if self.auto else "")

    def allowed(self) -> tuple[str, ...]:
        return self.choices() if self.choices else ()

    def check(self, value: Any) -> Any:
        """The value, normalised (ints as int, numbers as float); OptionError when it is bad."""
        if value is None and self.nullable:
            return None
        if self.auto and value == AUTO:
            return AUTO
        if self.kind == "choice":
            if isinstance(value, str) and value in self.allowed():
                return value
        elif self.kind == "strings":
            if isinstance(value, str):
                value = [value]
            if (
                isinstance(value, (list, tuple))
                and all(isinstance(s, str) for s in value)
                and (not self.max_items or len(value) <= self.max_items)
                and (not self.max_chars or sum(len(s) for s in value) <= self.max_chars)
            ):
                bad = next((s for s in value if not _utf8(s)), None)
                if bad is not None:  # a lone surrogate ("\udcff" in JSON): a prompt's is refused too
                    why = f"{quoted(bad)} is not valid UTF-8 text (a lone surrogate)"
                    raise OptionError(f"{self.name}: {why}", self.name)
                return [s for s in value if s]
        elif _is_number(value, integral=self.kind == "int") and self._in_range(value):
            return int(value) if self.kind == "int" else float(value)
        raise OptionError(f"{self.name} must be {self.describe()}, got {_shown(value)}", self.name)

    def parse(self, text: str) -> Any:
        """A command-line string -> a checked value (numbers parsed as the kind says)."""
        value: Any = text
        if self.kind in ("int", "float") and not (self.auto and text == AUTO):
            with contextlib.suppress(ValueError):  # unparsable: checked as the string typed
                value = int(text) if self.kind == "int" else float(text)
        return self.check(value)

    def _in_range(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or v <= self.hi


def _shown(v: Any) -> str:
    """A bad value as the message shows it: 3, 3.0 and "3" parsed from a command line read the same;
    a long value is cut to a prefix and its length."""
    if isinstance(v, float):
        return f"{v:g}"
    return quoted(v)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(v: Any, integral: bool) -> bool:
    if isinstance(v, bool):
        return False
    # An int is taken as it is: one past float's range (10**400 in a request) is then out of every
    # float option's range, where math.isfinite raised OverflowError (a 500 from the server).
    if integral or isinstance(v, int):
        return isinstance(v, int)
    return isinstance(v, float) and math.isfinite(v)


TREES = ("final", "full")
NO_REPEAT_MAX = 8  # longer n-grams hardly ever repeat within a context: nothing left to skip
REPEAT_N = 4  # the n-grams repeat_bar counts: the bench's rep-4 measures these
REPEAT_BAR_MAX = 1e6  # a bar no block that repeats can clear
VERIFY_RULES = ("block", "token")
GAMMA_MAX = 16  # the longest draft: llama.cpp's draft default is 16 too
WIDTH_MAX = 8  # the widest beam; MMTAD's full tree then has at most 8 x 16 nodes
SEED_MAX = 2**64 - 1
# Stop strings end an answer at a marker ("\n\nUser:", "</s>"): 4 (OpenAI's limit) of 4096
# characters in all is far beyond any real marker, and bounds what each request makes the server match.
PENALTY_MAX = 10.0  # llama.cpp's repeat penalty: 1.1-1.3 in use; past 10 a seen token is all but banned
LAST_N_MAX = 4096  # tokens the penalties look back over (llama.cpp: 64 by default)
STOP_MAX = 4
STOP_CHARS_MAX = 4096

OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "method",
            "choice",
            "auto",
            "How to decode; auto: mtad where this pair's measured costs say it pays, else sd.",
            choices=method_names,
        ),
        Option("max_tokens", "int", 256, "Most tokens to generate.", lo=1, recommended=True),
        Option(
            "temperature", "float", 1.0, "Randomness; 0 always takes the likeliest token.", lo=0, hi=2, recommended=True
        ),
        Option("top_k", "int", 10, "Sample from the k likeliest tokens; 0: all.", lo=0, recommended=True),
        Option(
            "top_p",
            "float",
            0.9,
            "Sample from the likeliest tokens that hold this much probability; 1: all.",
            lo=0,
            hi=1,
            lo_open=True,
            recommended=True,
        ),
        Option(
            "min_p",
            "float",
            0.0,
            "Keep tokens at least this share of the likeliest one's probability; 0 disables.",
            lo=0,
            hi=1,
        ),
        Option(
            "repeat_penalty",
            "float",
            1.0,
            "llama.cpp's repeat penalty on the tokens of the last repeat_last_n (logits divided by it, or "
            "multiplied where negative); 1 disables.",
            lo=0,
            hi=PENALTY_MAX,
            lo_open=True,
        ),
        Option(
            "repeat_last_n", "int", 64, "Tokens the penalties look back over (prompt included).", lo=0, hi=LAST_N_MAX
        ),
        Option(
            "presence_penalty",
            "float",
            0.0,
            "Subtracted from the logit of every token in the last repeat_last_n (OpenAI's); 0 disables.",
            lo=-2,
            hi=2,
        ),
        Option(
            "frequency_penalty",
            "float",
            0.0,
            "Subtracted from a token's logit once for each time it occurs in the last repeat_last_n; 0 disables.",
            lo=-2,
            hi=2,
        ),
        Option(
            "seed",
            "int",
            None,
            "Sampling seed, for a repeatable answer (default: random).",
            lo=0,
            hi=SEED_MAX,
            nullable=True,
        ),
        Option(
            "gamma",
            "int",
            AUTO,
            "Tokens drafted per step; auto: chosen each step from what drafting costs and gains.",
            lo=1,
            hi=GAMMA_MAX,
            auto=True,
        ),
        Option("gamma_max", "int", 8, "Longest draft gamma auto may choose.", lo=1, hi=GAMMA_MAX),
        Option(
            "gamma_min",
            "int",
            None,
            "Shortest draft gamma auto may choose; 0 allows plain steps (default: mtad-edge tune's floor, "
            "else 4 for mtad and mmtad when sampling, else 0).",
            lo=0,
            hi=GAMMA_MAX,
            nullable=True,
        ),
        Option(
            "beam_width",
            "int",
            4,
            "Beams the aux drafts with (mtad, mmtad); auto: chosen each step.",
            lo=1,
            hi=WIDTH_MAX,
            auto=True,
        ),
        Option(
            "tree",
            "choice",
            "final",
            "mmtad: verify the final beams (final) or every beam at every depth (full).",
            choices=lambda: TREES,
        ),
        Option(
            "drafter",
            "choice",
            AUTO,
            "Who drafts: the aux model, prompt lookup (ngram: copies from the text so far), or both; "
            "auto: both with gamma auto, else the aux.",
            choices=drafter_choices,
        ),
        Option(
            "verify",
            "choice",
            "block",
            "sd: check the draft as one block or token by token (both keep the target's distribution).",
            choices=lambda: VERIFY_RULES,
        ),
        Option(
            "no_repeat",
            "int",
            0,
            "Drafts skip a token that repeats an n-gram this long from the text (0: off).",
            lo=0,
            hi=NO_REPEAT_MAX,
        ),
        Option(
            "repeat_bar",
            "float",
            1.0,
            f"mtad: a drafted block that repeats a {REPEAT_N}-gram of the text must be this much likelier (1: off).",
            lo=1,
            hi=REPEAT_BAR_MAX,
        ),
        Option(
            "draft_ahead",
            "choice",
            "off",
            "sd, mtad: draft the next block while the target checks this one (same text; pays where the aux "
            "has its own device or cores).",
            choices=lambda: ("off", "on"),
        ),
        Option(
            "aux_shape",
            "choice",
            AUTO,
            "Aux calls of one shape: 'fixed' makes every drafting call of the aux evaluate the same rows "
            "(max(beam width, 2), filler rows padding the pending tokens and short depths), so llama.cpp "
            "keeps its CUDA graph, captured after two calls of one shape and dropped at any change; 'free' "
            "evaluates what each call needs; 'auto': fixed where the aux runs on a GPU with CUDA graphs, "
            "free elsewhere (on a CPU filler rows cost what real ones do). The texts are the same.",
            choices=lambda: (AUTO, "fixed", "free"),
        ),
        Option(
            "accept_threshold",
            "float",
            0.5,
            "mtad: keep the longest drafted prefix with p(x)/q(x) above this.",
            lo=0,
            hi=1,
            lo_open=True,
        ),
        Option(
            "stop",
            "strings",
            (),
            "Stop strings: the answer ends before the first one.",
            max_items=STOP_MAX,
            max_chars=STOP_CHARS_MAX,
        ),
    )
}


# The options a model may recommend defaults for, in the table's order.
RECOMMENDED = tuple(name for name, o in OPTIONS.items() if o.recommended)


def check(name: str, value: Any) -> Any:
    """Validate one option by name (OptionError names the parameter)."""
    opt = OPTIONS.get(name)
    if opt is None:
        raise OptionError(f"unknown option {quoted(name)}", quoted(name, bare=True))
    return opt.check(value)


def default(name: str) -> Any:
    return OPTIONS[name].default
