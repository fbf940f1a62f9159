"""Untrusted text on the terminal: the one rule every CLI command and the main job's console print by.

Here, not in ``cli/``, because the launcher's progress view (``job.progress``) prints by it too and ``job/``
never imports ``cli/`` (imports flow one way; ``tests/packaging/test_namespace.py``).

Env names, writers, actors, ledger reasons and URIs come from step files, chunk metadata
and ledger records that anyone with write access to a run may have written. Printed raw,
an escape code (``\\x1b[2J``) reaches the terminal and a rich markup tag (``[/bold]``)
crashes the command or restyles the output. ``printable`` shows control characters (C0,
C1, DEL, bidi overrides) as Python escapes; ``markup_safe`` also escapes rich markup, for
text that goes into ``Console.print`` or a ``Table``.
"""

from __future__ import annotations

import re

from rich.markup import escape

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(value: object) -> str:
    """``str(value)`` with every control character shown as its escape (``\\x1b``, ``\\n``, ``\\u202e``)."""
    return _CONTROL.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), str(value))


def markup_safe(value: object) -> str:
    """``printable(value)`` with rich markup escaped, so it prints as itself inside rich output."""
    return escape(printable(value))
