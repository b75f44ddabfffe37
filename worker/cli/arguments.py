"""Command-line text the commands pass on: checked once, with one clear line when it cannot be used."""

from __future__ import annotations

from worker.errors import UserError


def checked_argument_text(text: str, what: str) -> str:
    """`text` as given, or UserError when it is not valid UTF-8.

    Python hands undecodable argument bytes over as lone surrogates (PEP 383); they would fail much later,
    deep inside a tokenizer or an encoder, with a traceback instead of this line.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raw = text[error.start].encode("utf-8", "surrogateescape")
        raise UserError(
            f"{what} is not valid UTF-8 (byte 0x{raw.hex()} at character {error.start + 1}); "
            "pass UTF-8 text, or put the ticket in a --input file"
        ) from None
    return text
