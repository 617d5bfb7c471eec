"""Where human output goes and whether it is coloured: one decision for every command.

``--color auto`` colours a terminal unless ``NO_COLOR`` is set and not empty (no-color.org);
"no colour" means no escape codes at all, bold included. rich is imported only when a console
is made. Text goes through ``say``, never as rich markup: paths and quoted source hold brackets
(``self.kv_caches[layer_idx]``, a folder named ``[/x]``) that markup would eat or choke on.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console

COLOR_MODES = ("auto", "always", "never")

_mode = "auto"


def set_color(mode: str) -> None:
    """The process's colour mode, from ``--color`` (both readers take only ``COLOR_MODES``)."""
    global _mode
    _mode = mode


def console(file: TextIO, width: int | None = None) -> Console:
    from rich.console import Console

    if _mode == "never" or (_mode == "auto" and os.environ.get("NO_COLOR")):
        return Console(file=file, width=width, highlight=False, color_system=None)
    if _mode == "always":
        return Console(file=file, width=width, highlight=False, force_terminal=True, no_color=False)
    return Console(file=file, width=width, highlight=False)


def say(out: Console, text: str, style: str = "") -> None:
    """Print ``text`` exactly, on a line of its own: no markup, no emoji codes, no wrapping."""
    from rich.text import Text

    out.print(Text(text, style=style), soft_wrap=True)


class OutputError(Exception):
    """stdout cannot be written (a full disk, a closed pipe): the report is lost, not the files."""


def write_stdout(data: str | bytes) -> None:
    """Write ``data`` (bytes: exactly those) to stdout now; ``OutputError`` when it cannot be."""
    try:
        if isinstance(data, str):
            sys.stdout.write(data)
            sys.stdout.flush()
        else:
            sys.stdout.flush()
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
    except OSError as exc:
        raise OutputError(exc.strerror or str(exc)) from exc
