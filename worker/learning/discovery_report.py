"""What `taxonomy discover --out DIR` writes: the next step's inputs and a report for the person deciding.

- `taxonomy.toml`: the current taxonomy's text as it was, then each proposal as an intent, marked proposed
  by the comment above it (the taxonomy format has no such key, and `taxonomy check` must pass it as it is):
  delete the ones not accepted, rename the others, then train with it.
- `assignments.jsonl`: per ticket, `ticket_id`, its proposed intent (null: unassigned) and the cosine
  distance to the nearest proposal's centre.
- `labelled.csv`: the assigned tickets as `text,label` rows, what `model train --data` reads.
- `report.md` and `groups.svg`: the sizes (a picture first), each proposal's description, five examples
  and flags (duplicates of existing intents, overlapping pairs), and growth by day where tickets carry
  `created_at`.

Every copy of ticket text here (the CSV rows, the examples) is the text redacted by the caller's redactor,
as every training file is (docs/privacy.md).
"""

from __future__ import annotations

import csv
import dataclasses
import html
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from worker.learning.discovery import UNASSIGNED, Discovery, ProposedIntent

BAR_WIDTH = 40
GROWTH_DAYS = 14


@dataclasses.dataclass(frozen=True)
class DiscoveredTicket:
    """One clustered ticket: its id, its redacted text and when it was created (RFC 3339, if it says)."""

    ticket_id: str
    text: str
    created_at: str | None = None


def proposed_taxonomy(current: str, found: Discovery, priority: str, source: str) -> str:
    """`current` (a taxonomy's TOML text, or a header for a new one) with the proposals appended."""
    lines = [current.rstrip("\n"), ""]
    for intent in found.intents:
        lines += [
            "[[intents]]",
            f"# proposed by `triage-worker taxonomy discover` from {source}: {len(intent.members)} tickets"
            + (f"; looks like `{intent.duplicate_of}`" if intent.duplicate_of else ""),
            f"name = {json.dumps(intent.name)}",
            f"description = {json.dumps(intent.description)}",
            f"priority = {json.dumps(priority)}",
            "",
        ]
    return "\n".join(lines)


def new_taxonomy_header(name: str, fallback: str, priorities: Sequence[str]) -> str:
    """The head of a taxonomy for a team without one (`--all` without `--taxonomy`)."""
    return "\n".join(
        [
            "# Taxonomy proposed by `triage-worker taxonomy discover --all`: every intent below is a",
            "# proposal; rename, merge or delete them, set each priority, then `taxonomy check` it.",
            f"name = {json.dumps(name)}",
            f"fallback_intent = {json.dumps(fallback)}",
            'fallback_priority = "Medium"',
            f"priorities = {json.dumps(list(priorities))}",
        ]
    )


def write_assignments(path: Path, tickets: Sequence[DiscoveredTicket], found: Discovery) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row, ticket in enumerate(tickets):
            group = int(found.assignment[row])
            record = {
                "ticket_id": ticket.ticket_id,
                "proposed_intent": None if group == UNASSIGNED else found.intents[group].name,
                "distance": round(float(found.distance[row]), 4),
            }
            out.write(json.dumps(record) + "\n")


def write_labelled(path: Path, tickets: Sequence[DiscoveredTicket], found: Discovery) -> int:
    """The assigned tickets as training rows; how many."""
    with path.open("w", encoding="utf-8", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["text", "label"])
        for intent in found.intents:
            for row in intent.members:
                writer.writerow([tickets[row].text, intent.name])
    return sum(len(intent.members) for intent in found.intents)


def size_chart_svg(intents: Sequence[ProposedIntent]) -> str:
    """A horizontal bar chart of the proposals' sizes, largest first."""
    height = 22 * len(intents) + 30
    largest = max((len(i.members) for i in intents), default=1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="720" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        '<text x="10" y="18" font-weight="bold">Proposed intents by tickets</text>',
    ]
    for row, intent in enumerate(intents):
        y = 30 + 22 * row
        width = 400 * len(intent.members) / largest
        colour = "#d95f02" if intent.duplicate_of else "#1b9e77"
        parts += [
            f'<text x="10" y="{y + 14}">{html.escape(intent.name)}</text>',
            f'<rect x="260" y="{y + 3}" width="{width:.1f}" height="15" fill="{colour}"/>',
            f'<text x="{265 + width:.1f}" y="{y + 14}">{len(intent.members)}</text>',
        ]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def text_bars(intents: Sequence[ProposedIntent]) -> list[str]:
    """The same chart in characters, for a terminal or a plain-text reader."""
    largest = max((len(i.members) for i in intents), default=1)
    width = max((len(i.name) for i in intents), default=0)
    return [
        f"{i.name:<{width}} {'█' * max(1, round(BAR_WIDTH * len(i.members) / largest))} {len(i.members)}"
        for i in intents
    ]


def growth_lines(tickets: Sequence[DiscoveredTicket], found: Discovery) -> list[str]:
    """A table of tickets per day (the last `GROWTH_DAYS` days with tickets) per proposal; none when no
    ticket carries `created_at`."""
    days = sorted({t.created_at[:10] for t in tickets if t.created_at})[-GROWTH_DAYS:]
    if not days:
        return []
    lines = ["| intent | " + " | ".join(days) + " |", "|---|" + "---|" * len(days)]
    for intent in found.intents:
        per_day = Counter((tickets[row].created_at or "")[:10] for row in intent.members)
        lines.append(f"| {intent.name} | " + " | ".join(str(per_day[day]) for day in days) + " |")
    return lines


def report(tickets: Sequence[DiscoveredTicket], found: Discovery, source: str) -> str:
    """report.md: the picture, then the numbers, the proposals and the flags."""
    unassigned = int((found.assignment == UNASSIGNED).sum())
    lines = [
        f"# Proposed intents from {source}",
        "",
        "![proposed intents by tickets](groups.svg)",
        "",
        "```",
        *text_bars(found.intents),
        "```",
        "",
        f"{len(tickets)} tickets clustered: {len(found.intents)} proposed intents, {unassigned} tickets left "
        "unassigned (one-off tickets and incoherent leftovers). K was estimated from the silhouette of "
        f"{len(found.silhouettes)} groupings.",
        "",
    ]
    growth = growth_lines(tickets, found)
    if growth:
        lines += ["## Growth by day (tickets created)", "", *growth, ""]
    duplicates = [i for i in found.intents if i.duplicate_of]
    if duplicates:
        lines += ["## Looks like an existing intent", ""]
        lines += [
            f"- `{i.name}` looks like `{i.duplicate_of}` (centres {i.duplicate_similarity:.3f} alike): the "
            "out-of-scope threshold may be the thing to move, rather than the taxonomy"
            for i in duplicates
        ]
        lines.append("")
    if found.overlaps:
        lines += ["## Overlapping proposals", ""]
        lines += [
            f"- `{o.first}` and `{o.second}` (centres {o.similarity:.3f} alike): one intent split in two, "
            "or two a person should tell apart"
            for o in found.overlaps
        ]
        lines.append("")
    lines += ["## Proposals", ""]
    for intent in found.intents:
        lines += [
            f"### `{intent.name}` — {len(intent.members)} tickets",
            "",
            f"{intent.description}. Cohesion {intent.cohesion:.3f}.",
            "",
            *(f"- {tickets[row].text.replace(chr(10), ' ')}" for row in intent.examples),
            "",
        ]
    return "\n".join(lines)
