"""The `mtad-edge` console script. It installs the signal handling (mtad_edge/signals.py) before
anything heavy is imported, so a Ctrl-C or SIGTERM at any moment after start-up ends the process
with 130 / 143, never with a traceback, a segfault or the signal's default action."""

from __future__ import annotations

import sys

from mtad_edge.signals import interrupts


def main() -> None:
    interrupts.install()
    code = 1
    try:
        from mtad_edge.cli import cli  # imports every command: numpy, click, ...

        cli()  # click's standalone mode always ends in SystemExit
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # a signal while the commands were being imported
        print("Aborted!", file=sys.stderr)
    interrupts.finish(code)
