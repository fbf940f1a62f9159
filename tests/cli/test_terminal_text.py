"""Untrusted text reaches the terminal as itself (issue 14 input 9): rich markup and escape codes in env names."""

from __future__ import annotations

from refpipe.job.text import markup_safe, printable
from refpipe.pipeline.step_file import publish_step_file
from refpipe.storage.backends import open_store
from tests.cli.test_inspect import invoke, keep_branches, packed_header

HOSTILE = {"math": "[/bold]", "code": "\x1b[2J\x1b[31mred", "chat": "[red]x[/red]\u202egnp.exe"}


def test_printable_and_markup_safe_show_control_characters_and_markup_as_text():
    assert printable("\x1b[2J\tA\u202e\x9b") == "\\x1b[2J\\tA\\u202e\\x9b"
    assert markup_safe("[/bold] é") == "\\[/bold] é"


def test_inspect_prints_hostile_env_names_as_text(local_config):
    """``[/bold]`` as an env name crashed ``refpipe inspect`` with a rich MarkupError traceback; an escape code
    reached the terminal raw."""
    store = open_store(local_config)
    _, refs, _ = keep_branches(store, local_config)
    header, streams = packed_header(store, refs, 0)
    renamed = [mb.model_copy(update={"sequences": [s.model_copy(update={"env_name": HOSTILE[s.env_name]})
                                                   for s in mb.sequences]}) for mb in header.micro_batches]
    hostile = header.model_copy(update={"micro_batches": renamed})
    uri = publish_step_file(store, hostile, streams)
    result = invoke(["inspect", uri])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert "[/bold] x2" in result.stdout and "\\x1b[2J\\x1b[31mred" in result.stdout
    assert "[red]x[/red]\\u202egnp.exe" in result.stdout
