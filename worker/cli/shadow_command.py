"""`triage-worker shadow report`: how often the shadow model agrees with the primary, from the side topic.

It reads the side topic (`topics.shadow`) from its beginning to its end as of the start, by assignment: no
group is joined and nothing is committed, so a report never disturbs another and can run any time. Records
are counted once per source position (a ticket redone after a crash or rebalance has two side records; the
last one counts and the rest are reported as duplicates). Shadow answers that were fallbacks are counted
apart and not compared.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import msgspec

from worker.kafka.side_topics import read_side_topic
from worker.messages import ShadowResult
from worker.settings import add_config_argument, settings_from_args

_DECODER = msgspec.json.Decoder(ShadowResult)

Position = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class _Answer:
    primary_intent: str
    shadow_intent: str | None  # None: the shadow answered with a fallback
    fallback_reason: str | None
    models: tuple[str, str]


@dataclass
class ShadowTally:
    """Side records, the last one per source position."""

    answers: dict[Position, _Answer] = field(default_factory=dict)
    records: int = 0
    undecodable: int = 0
    duplicates: int = 0

    def add(self, value: bytes | None) -> None:
        try:
            result = _DECODER.decode(value or b"")
        except msgspec.DecodeError:
            self.undecodable += 1
            return
        self.records += 1
        position = (result.source.topic, result.source.partition, result.source.offset)
        if position in self.answers:
            self.duplicates += 1
        self.answers[position] = _Answer(
            result.primary_intent,
            None if result.fallback else result.intent,
            result.fallback_reason,
            (result.primary_model, result.model),
        )


def summarize(tally: ShadowTally, topic: str) -> dict[str, Any]:
    """The report as data (what `--json` prints): totals, per primary intent, and every disagreeing pair."""
    fallbacks: collections.Counter[str] = collections.Counter()
    models: collections.Counter[tuple[str, str]] = collections.Counter()
    compared: collections.Counter[str] = collections.Counter()
    agreed: collections.Counter[str] = collections.Counter()
    pairs: collections.Counter[tuple[str, str]] = collections.Counter()
    for answer in tally.answers.values():
        models[answer.models] += 1
        if answer.shadow_intent is None:
            fallbacks[answer.fallback_reason or "unknown"] += 1
            continue
        compared[answer.primary_intent] += 1
        if answer.shadow_intent == answer.primary_intent:
            agreed[answer.primary_intent] += 1
        else:
            pairs[(answer.primary_intent, answer.shadow_intent)] += 1
    total_compared, total_agreed = sum(compared.values()), sum(agreed.values())
    instead: dict[str, tuple[str, int]] = {}
    for (primary, shadow), count in pairs.most_common():
        instead.setdefault(primary, (shadow, count))
    return {
        "topic": topic,
        "records": tally.records,
        "tickets": len(tally.answers),
        "duplicates": tally.duplicates,
        "undecodable": tally.undecodable,
        "compared": total_compared,
        "agreed": total_agreed,
        "agreement": _ratio(total_agreed, total_compared),
        "shadow_fallbacks": dict(sorted(fallbacks.items())),
        "models": [
            {"primary": primary, "shadow": shadow, "tickets": count}
            for (primary, shadow), count in models.most_common()
        ],
        "intents": [
            {
                "intent": intent,
                "compared": count,
                "agreed": agreed[intent],
                "agreement": _ratio(agreed[intent], count),
                "most_often_instead": (
                    {"intent": instead[intent][0], "count": instead[intent][1]} if intent in instead else None
                ),
            }
            for intent, count in sorted(compared.items(), key=lambda item: (-item[1], item[0]))
        ],
        "disagreements": [
            {"primary": primary, "shadow": shadow, "count": count}
            for (primary, shadow), count in sorted(pairs.items(), key=lambda item: (-item[1], item[0]))
        ],
    }


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def render(summary: dict[str, Any], top: int) -> str:
    """The report as a table: per primary intent, then the `top` pairs that disagree most."""
    lines = [
        f"shadow report: {summary['topic']}: {summary['records']} records, {summary['tickets']} tickets "
        f"({summary['duplicates']} duplicates, {summary['undecodable']} undecodable)"
    ]
    lines += [
        f"models: {m['primary']} (primary) vs {m['shadow']} (shadow): {m['tickets']}"
        for m in summary["models"]
    ]
    fallbacks = ", ".join(f"{reason} {count}" for reason, count in summary["shadow_fallbacks"].items())
    lines.append(
        f"agreement: {summary['agreed']}/{summary['compared']} = {_percent(summary['agreement'])}"
        + (f" (not compared, shadow fallbacks: {fallbacks})" if fallbacks else "")
    )
    if summary["intents"]:
        width = max(len("primary intent"), *(len(row["intent"]) for row in summary["intents"]))
        lines += ["", f"{'primary intent':<{width}}  compared  agreed  agreement  most often instead"]
        for row in summary["intents"]:
            other = row["most_often_instead"]
            instead = f"{other['intent']} ({other['count']})" if other else "-"
            lines.append(
                f"{row['intent']:<{width}}  {row['compared']:>8}  {row['agreed']:>6}  "
                f"{_percent(row['agreement']):>9}  {instead}"
            )
    pairs = summary["disagreements"][:top]
    if pairs:
        compared = {row["intent"]: row["compared"] for row in summary["intents"]}
        lines += ["", f"top {len(pairs)} disagreements (primary -> shadow):"]
        for pair in pairs:
            share = _percent(pair["count"] / compared[pair["primary"]])
            lines.append(
                f"  {pair['primary']} -> {pair['shadow']}: {pair['count']} ({share} of {pair['primary']})"
            )
    return "\n".join(lines) + "\n"


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser("shadow", help="compare the shadow model with the primary")
    actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
    report = actions.add_parser(
        "report",
        help="agreement table from the shadow side topic (reads it to its current end; commits nothing)",
    )
    add_config_argument(report)
    report.add_argument("--bootstrap-servers", metavar="SERVERS", help="Kafka bootstrap servers, host:port")
    report.add_argument("--topic", help="side topic (default topics.shadow: tickets.triaged.shadow)")
    report.add_argument(
        "--top", type=int, default=10, metavar="N", help="disagreeing pairs shown (default 10)"
    )
    report.add_argument("--json", action="store_true", help="print the report as one JSON object")
    report.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    settings = settings_from_args(
        args, {"kafka.bootstrap.servers": args.bootstrap_servers, "topics.shadow": args.topic}
    )
    topic = settings.topics.shadow
    tally = ShadowTally()

    def progress(read: int, total: int) -> None:
        print(f"read {read} of at most {total} records from {topic}", file=sys.stderr, flush=True)

    read_side_topic(
        settings.kafka, settings.pipeline, topic, lambda message: tally.add(message.value()), progress
    )
    summary = summarize(tally, topic)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        sys.stdout.write(render(summary, max(0, args.top)))
    return 0
