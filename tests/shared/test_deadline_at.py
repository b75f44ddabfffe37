"""`metadata.deadline_at`: every RFC 3339 spelling the decoder accepts is the deadline the ticket gets, and
every value that is not a timestamp is a dead letter (`invalid_timestamp`), never silently ignored.

Issue 55: `2024-05-01t12:30:00z` (RFC 3339 §5.6 allows lower-case t and z) was accepted by the decoder
and then dropped by the deadline, which read it with Python 3.11's `fromisoformat` (no lower-case z): a
ticket past its deadline was classified. The spellings and the broken values here are generated
(hypothesis, derandomized).
"""

from __future__ import annotations

import datetime

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from worker.decoding import DecodeError, decode_ticket
from worker.pipeline.triage.deadlines import ticket_deadline

LIMIT = 1_048_576
# Far beyond any generated deadline, so the producer's deadline_at is always the earlier one.
CONFIGURED_MS = 10**15
POLLED_MONOTONIC = 1_000.0

GENERATED = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)


def _ticket(deadline_at: str) -> bytes:
    return msgspec.json.encode(
        {"ticket_id": "T", "body": "my card is blocked", "metadata": {"deadline_at": deadline_at}}
    )


@st.composite
def spellings(draw: st.DrawFn) -> tuple[str, float]:
    """One RFC 3339 spelling of a generated instant, and the instant (Unix seconds) it names."""
    whole = draw(
        st.datetimes(min_value=datetime.datetime(1971, 1, 1), max_value=datetime.datetime(2200, 1, 1))
    ).replace(microsecond=0, tzinfo=datetime.UTC)
    offset_minutes = draw(
        st.sampled_from([0, 0, 60, -300, 330, 345, -570, 840, -(23 * 60 + 59), 23 * 60 + 59])
    )
    local = whole.astimezone(datetime.timezone(datetime.timedelta(minutes=offset_minutes)))
    fraction = draw(st.none() | st.text("0123456789", min_size=1, max_size=12))
    text = local.strftime("%Y-%m-%d") + draw(st.sampled_from("Tt")) + local.strftime("%H:%M:%S")
    if fraction is not None:
        text += f".{fraction}"
    if offset_minutes == 0:
        text += draw(st.sampled_from(["Z", "z", "+00:00", "-00:00"]))
    else:
        sign = "+" if offset_minutes > 0 else "-"
        hours, minutes = divmod(abs(offset_minutes), 60)
        text += f"{sign}{hours:02d}:{minutes:02d}"
    return text, whole.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


@GENERATED
@given(spellings(), st.floats(-3_600.0, 3_600.0))
@example(("2024-05-01t12:30:00z", 1_714_566_600.0), 300.0)  # the value, five minutes past
@example(("2024-05-01T12:30:00z", 1_714_566_600.0), -300.0)
@example(("2024-05-01t12:30:00.25-07:00", 1_714_591_800.25), 1.0)
def test_every_accepted_spelling_is_the_deadline_the_ticket_gets(
    spelling: tuple[str, float], late_s: float
) -> None:
    """Polled `late_s` after the instant named (negative: before it): the deadline is that instant."""
    text, instant = spelling
    event = decode_ticket(_ticket(text), LIMIT)  # accepted

    deadline = ticket_deadline(POLLED_MONOTONIC, instant + late_s, CONFIGURED_MS, event.metadata)

    assert deadline == pytest.approx(POLLED_MONOTONIC - late_s, abs=1e-3)


@st.composite
def broken(draw: st.DrawFn) -> str:
    """A value that is not an RFC 3339 date-time: a valid spelling broken in one generated way."""
    text, _ = draw(spellings())
    date, time = text[:10], text[11:]
    separator = text[10]
    how = draw(
        st.sampled_from(
            [
                "no offset",
                "month 13",
                "day 32",
                "february 30",
                "hour 24",
                "minute 60",
                "leap second",
                "offset hour 24",
                "offset without colon",
                "space separator",
                "no separator",
                "trailing newline",
                "trailing text",
                "empty fraction",
                "arabic-indic digits",
                "two-digit year",
                "date only",
                "epoch seconds",
                "empty",
            ]
        )
    )
    clock = time[:8]
    offset = time[8:].split(".")[-1].lstrip("0123456789") if "." in time else time[8:]
    broken_values = {
        "no offset": f"{date}{separator}{clock}",
        "month 13": f"{date[:5]}13{date[7:]}{separator}{time}",
        "day 32": f"{date[:8]}32{separator}{time}",
        "february 30": f"{date[:5]}02-30{separator}{time}",
        "hour 24": f"{date}{separator}24{time[2:]}",
        "minute 60": f"{date}{separator}{clock[:3]}60{time[5:]}",
        "leap second": f"{date}{separator}23:59:60{offset}",
        "offset hour 24": f"{date}{separator}{clock}+24:00",
        "offset without colon": f"{date}{separator}{clock}+0130",
        "space separator": f"{date} {time}",
        "no separator": f"{date}{time}",
        "trailing newline": f"{text}\n",
        "trailing text": f"{text} please",
        "empty fraction": f"{date}{separator}{clock}.{offset}",
        "arabic-indic digits": text.translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")),
        "two-digit year": f"{date[2:]}{separator}{time}",
        "date only": date,
        "epoch seconds": str(draw(st.integers(0, 2**33))),
        "empty": "",
    }
    return broken_values[how]


@GENERATED
@given(broken() | st.text(max_size=30).filter(lambda text: "-" not in text))
@example("garbage")
@example("2024-05-01T12:30:00")
@example("2024-02-30T12:30:00Z")
def test_a_value_that_is_not_a_timestamp_is_a_dead_letter_naming_the_field(text: str) -> None:
    with pytest.raises(DecodeError) as refused:
        decode_ticket(_ticket(text), LIMIT)

    assert refused.value.error_type == "invalid_timestamp"
    assert refused.value.message.startswith(
        "`metadata.deadline_at` must be an RFC 3339 timestamp like 2024-05-01T12:30:00Z, got "
    )
