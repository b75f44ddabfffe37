"""`python -m tools.bench`'s output: bench.json (everything measured), bench.md (the table of figures against
their goals, the machine and the command) and two PNG plots."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

DEADLINE_MS = 2000  # pipeline.deadline_ms's default, which the worker ran with
MB = 1024 * 1024
# "Flat" at 200 %: the worker tree's RSS stays within +10 % of its value when the level began.
RSS_TOLERANCE = 0.10
HOW = """How: P1 and P2 time from the first record taken (P1) or the first produce (P2, the worker already
assigned) until the group's committed offsets equal the input's end offsets, or until the time budget runs
out (then the rate is over what was committed). P1 runs the real `Pipeline` in-process with a classifier
that answers at once; its baseline is a bare consume/decode/produce/commit loop with the same client
options. P2's worker runs the first stage alone (`--escalation off`; P7 measures the cascade); its baseline
is `open_pool` with default inference settings, every text submitted at once and drained with poll. P2's
default path is `triage-worker classify --input FILE` with default settings, timed as a whole command
(start-up included; CPU of its whole tree, every process reaped) and alternated with the same command from
the pinned commit's worktree, the medians quoted; answers are compared with this checkout's first run. P3's
baseline is one process, a new Generator with the whole prompt per ticket, schema-guided generation, batch
1. CPU is user+system time of the process tree (/proc) over the same
window. P4 offers each load for a fixed time against one worker with default settings and lets the backlog
drain before the next level; "deadline fallbacks" are `deadline_exceeded` + `overloaded`. P5 runs two workers
that differ only in `--scheduling` (both with `--max-in-flight` sized to hold a level's backlog at 150 % and
`--deadline-ms` = the loose budget) and offers each level to one, lets it drain, then to the other; a miss is
a ticket answered `overloaded` or `deadline_exceeded`, or classified after its `deadline_at` (output record
timestamp). P6 runs two workers with default settings except `--guarantee` (the exactly-once one with its
own `--transactional-id`), each on its own topics: throughput is timed as in P2 (at-least-once before and
after exactly-once); latency offers 70 % of the capacity (P2's, or the at-least-once burst rate if lower) to
one, lets it drain, then to the other, and is measured from the input record's timestamp to the moment a
`read_committed` consumer (polling on its own thread, one record per call) received the result; lost and
duplicates are counted from outputs read `read_committed`."""

P6_WHY = """Why exactly-once costs what it costs (P6): a commit is a Kafka transaction, not an offset commit.
Each one is a round trip to the transaction coordinator (offsets added to the transaction, then EndTxn,
which writes a commit marker into every partition the transaction touched), and the loop produces nothing
while it is on its way and sends it only once every record in it is acknowledged. Results become visible to
a `read_committed` reader only when their transaction commits, not when they are produced: a result waits on
average half the time between commits (`commit_interval_ms`, 1 s by default, or less when done work fills half
of `max_in_flight`, as it does at this load) plus the commit itself. A partition's outputs are released in
input order, so one slow ticket holds back those after it. At-least-once results are not transactional and
are visible as soon as they are written; its commits only move the group's offsets."""


def epoch(timestamp: str) -> float:
    """A structlog ISO timestamp (`...Z`) as seconds since the epoch."""
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _met(ok: bool) -> str:
    return "yes" if ok else "**NO — missed**"


def _level(figures: dict[str, Any], pct: int) -> dict[str, Any]:
    levels: list[dict[str, Any]] = figures["p4"]["levels"]
    return next(level for level in levels if level["load_pct"] == pct)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} ms"


def _partial(run: dict[str, Any], total: int) -> str:
    """A run cut by its time budget is rated over what it committed; the table says so."""
    return "" if run["complete"] else f" (budget ran out: {run['records']:,} of {total:,} committed)"


def _spread(baseline: dict[str, Any]) -> str:
    return f" (mean of {baseline['before']['rate']:,.0f} before, {baseline['after']['rate']:,.0f} after)"


def _reasons(fallbacks: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in sorted(fallbacks.items())) or "none"


def _ratio(value: int, baseline: int) -> str:
    return "n/a" if baseline == 0 else f"{value / baseline:.2f}x"


def _p5_side(name: str, level: dict[str, Any]) -> str:
    return (
        f"{name}: {level['missed']:,} of {level['tickets']:,} missed ({level['missed_tight']:,} tight, "
        f"{level['missed_loose']:,} loose); {level['in_time']:,} classified in time"
    )


def _p5_rows(p5: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    found = []
    due = f"half the tickets due {p5['tight_s']:g} s after produced, half {p5['loose_s']:g} s"
    for fifo, edf in zip(p5["fifo"]["levels"], p5["edf"]["levels"], strict=True):
        misses, in_time = _ratio(edf["missed"], fifo["missed"]), _ratio(edf["in_time"], fifo["in_time"])
        found.append(
            (
                f"P5 at {fifo['load_pct']} %: deadline misses, EDF vs FIFO ({due}; "
                f"max_in_flight {p5['max_in_flight']})",
                _p5_side("FIFO", fifo),
                _p5_side("EDF", edf),
                f"misses {misses}; in time {in_time}",
                "fewer misses",
                "-" if fifo["missed"] == 0 else _met(edf["missed"] < fifo["missed"]),
            )
        )
    return found


def _p6_latency(run: dict[str, Any]) -> str:
    latency = run["latency"]
    unseen = latency["tickets"] - latency["visible"]
    return f"p50 {_ms(latency['p50_ms'])}, p99 {_ms(latency['p99_ms'])}" + (
        f" ({unseen:,} of {latency['tickets']:,} never visible)" if unseen else ""
    )


def _p6_audit(run: dict[str, Any]) -> str:
    return f"{run['lost']} lost, {run['duplicates']} duplicates of {run['inputs']:,} inputs"


def _p6_rows(p6: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    alo, eos = p6["at_least_once"], p6["exactly_once"]
    ratios = [f"{name} {value:.2f}x" for name, value in (("p50", p6["p50_ratio"]), ("p99", p6["p99_ratio"]))]
    return [
        (
            f"P6 exactly-once throughput: `--guarantee exactly_once` vs `at_least_once` "
            f"({p6['tickets']:,} tickets at once)",
            f"{alo['throughput']['rate']:,.1f} tickets/s{_spread(alo['throughput'])}"
            f"{_partial(alo['throughput'], p6['tickets'])}",
            f"{eos['throughput']['rate']:,.1f} tickets/s{_partial(eos['throughput'], p6['tickets'])}",
            f"{p6['throughput_ratio']:.2f}x",
            "reported",
            "-",
        ),
        (
            f"P6 at {p6['load_pct']} %: latency to a read_committed reader, exactly-once vs at-least-once",
            _p6_latency(alo),
            _p6_latency(eos),
            "; ".join(ratios),
            "reported",
            "-",
        ),
        (
            "P6 audit (outputs read read_committed): lost; duplicates",
            f"ALO: {_p6_audit(alo)}",
            f"EOS: {_p6_audit(eos)}; {eos['transactions']:,} transactions, "
            f"{eos['transactions_aborted']} aborted",
            "-",
            "0 lost; EOS 0 duplicates",
            _met(alo["lost"] == 0 and eos["lost"] == 0 and eos["duplicates"] == 0),
        ),
    ]


P7_HOW = """How (P7): two workers, one with default settings (the cascade, on by default with the embedded
model, at its default threshold) and one with `--escalation off` (the first stage alone), each on its own
topics, the same BANKING77 test tickets (`{"ticket_id", "body"}`, test.csv in file order): throughput is
timed as in P2 (the first stage alone before and after the cascade); accuracy is the intent of each worker's
records against the tickets' labels. Under a burst the gate sheds escalations only when the tickets waiting
for the first stage are at risk of missing their deadline (the 64 in flight at 2 s each are not): the
cascade's throughput is what its escalations cost."""


def _p7_rows(p7: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    first, cascade = p7["first_stage"], p7["cascade"]
    skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(cascade["escalation_skipped"].items())) or "none"
    return [
        (
            f"P7 the cascade: worker with the escalation stage (below {p7['escalate_below']}) vs the first "
            f"stage alone ({p7['tickets']:,} tickets at once)",
            f"{first['throughput']['rate']:,.1f} tickets/s{_spread(first['throughput'])}"
            f"{_partial(first['throughput'], p7['tickets'])}",
            f"{cascade['throughput']['rate']:,.1f} tickets/s{_partial(cascade['throughput'], p7['tickets'])}",
            f"{p7['ratio']:.2f}x",
            "≥ 0.6x",
            _met(p7["ratio"] >= 0.6),
        ),
        (
            "P7 what the records say: intent accuracy against the labels; escalated; escalations skipped",
            f"{first['accuracy']:.2%}",
            f"{cascade['accuracy']:.2%}; {cascade['escalated_share']:.1%} escalated; skipped: {skipped}",
            f"{100 * (cascade['accuracy'] - first['accuracy']):+.2f} points",
            "reported",
            "-",
        ),
    ]


def _p2_row(p2: dict[str, Any]) -> tuple[str, str, str, str, str, str]:
    return (
        "P2 inference overhead: `triage-worker run` (defaults) vs raw pool",
        f"{p2['pool']['rate']:,.1f} tickets/s{_spread(p2['pool'])}",
        f"{p2['worker']['rate']:,.1f} tickets/s{_partial(p2['worker'], p2['pool']['tickets'])}",
        f"{p2['ratio']:.2f}x",
        "≥ 0.9x",
        _met(p2["ratio"] >= 0.9),
    )


def _classify_side(side: dict[str, Any]) -> str:
    return f"{side['rate']:,.1f} tickets/s, {side['cpu_ms_per_ticket']:.2f} ms CPU per ticket"


def _classify_rows(p2: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """P2's default path in absolute figures (tools/bench/p2_classify.py), against the pinned commit when the
    run had one: the rate and the CPU per ticket, each with its goal, and whether the answers moved."""
    classify = p2.get("classify")
    if classify is None:
        return []
    current, baseline = classify["current"], classify.get("baseline")
    what = (
        "P2 default path: `triage-worker classify --input` (defaults), "
        f"{classify['tickets']:,} BANKING77 tickets"
    )
    stages = ", ".join(f"{stage} {count:,}" for stage, count in sorted(current["stages"].items()))
    if baseline is None:
        return [(what, "-", _classify_side(current), "-", "reported", "-")]
    pin = classify["baseline_commit"]
    return [
        (
            f"{what}: rate vs {pin}",
            f"{baseline['rate']:,.1f} tickets/s",
            f"{current['rate']:,.1f} tickets/s",
            f"{classify['rate_ratio']:.2f}x",
            "≥ 1x",
            _met(classify["rate_ratio"] >= 1.0),
        ),
        (
            f"{what}: CPU per ticket (whole process tree) vs {pin}",
            f"{baseline['cpu_ms_per_ticket']:.2f} ms",
            f"{current['cpu_ms_per_ticket']:.2f} ms",
            f"{classify['cpu_ratio']:.2f}x",
            "≤ 1x",
            _met(classify["cpu_ratio"] <= 1.0),
        ),
        (
            f"P2 default path: answers (intent, priority, confidence, out of scope) vs {pin}; stages",
            f"{classify['tickets']:,} tickets",
            f"{baseline['answers_differing']:,} differ; {stages}",
            "-",
            "reported",
            "-",
        ),
    ]


def rows(figures: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """(figure, baseline, measured, ratio, goal, met?) for the table."""
    p1, p2, p3, p4 = figures["p1"], figures["p2"], figures["p3"], figures["p4"]
    at70, at200 = _level(figures, 70), _level(figures, 200)
    deadline_fallbacks = sum(at70["fallbacks"].get(r, 0) for r in ("deadline_exceeded", "overloaded"))
    p99 = at70["p99_ms"]
    rss_start, rss_max = at200["rss_start_bytes"], at200["rss_max_bytes"]
    rss_ratio = rss_max / rss_start if rss_start and rss_max else None
    cpu_ratio = p2["worker"]["cpu_ms_per_ticket"] / p2["pool"]["cpu_ms_per_ticket"]
    return [
        (
            "P1 Kafka overhead: `Pipeline` + instant classifier vs bare loop",
            f"{p1['bare']['rate']:,.0f} rec/s{_spread(p1['bare'])}{_partial(p1['bare'], p1['records'])}",
            f"{p1['pipeline']['rate']:,.0f} rec/s{_partial(p1['pipeline'], p1['records'])}",
            f"{p1['ratio']:.2f}x",
            "≥ 0.8x",
            _met(p1["ratio"] >= 0.8),
        ),
        (
            f"P1, bound lifted (`max_in_flight={p1['lifted']['max_in_flight']}`): the loop's own cost",
            f"{p1['bare']['rate']:,.0f} rec/s",
            f"{p1['lifted']['rate']:,.0f} rec/s{_partial(p1['lifted'], p1['records'])}",
            f"{p1['lifted_ratio']:.2f}x",
            "≥ 0.8x",
            _met(p1["lifted_ratio"] >= 0.8),
        ),
        _p2_row(p2),
        *_classify_rows(p2),
        (
            "P3 beyond the seed design: worker vs new Generator + guided generation per ticket",
            f"{p3['seed']['rate']:,.1f} tickets/s",
            f"{p2['worker']['rate']:,.1f} tickets/s",
            f"{p3['ratio']:.1f}x",
            "≥ 10x",
            _met(p3["ratio"] >= 10),
        ),
        (
            "P3 in CPU time: seed design's CPU-ms per ticket vs the worker tree's",
            f"{p3['seed']['cpu_ms_per_ticket']:.2f} ms",
            f"{p2['worker']['cpu_ms_per_ticket']:.2f} ms",
            f"{p3['seed']['cpu_ms_per_ticket'] / p2['worker']['cpu_ms_per_ticket']:.1f}x",
            "reported",
            "-",
        ),
        (
            "CPU cost per ticket: worker tree vs raw pool (bench process + pool)",
            f"{p2['pool']['cpu_ms_per_ticket']:.2f} ms",
            f"{p2['worker']['cpu_ms_per_ticket']:.2f} ms",
            f"{cpu_ratio:.2f}x",
            "reported",
            "-",
        ),
        *(
            [
                (
                    "CPU per ticket of the broker during P2 (same 2 cores as the worker)",
                    "-",
                    f"{broker_ms:.2f} ms",
                    f"{broker_ms / p2['worker']['cpu_ms_per_ticket']:.2f}x of the worker tree's",
                    "reported",
                    "-",
                )
            ]
            if (broker_ms := p2["worker"].get("broker_cpu_ms_per_ticket")) is not None
            else []
        ),
        (
            "P4 at 70 %: p99 latency vs the deadline; deadline fallbacks",
            f"{DEADLINE_MS:,} ms",
            f"p99 {_ms(p99)}; {deadline_fallbacks} deadline fallbacks",
            "n/a" if p99 is None else f"{p99 / DEADLINE_MS:.2f}x",
            "≤ 1x and 0",
            _met(p99 is not None and p99 <= DEADLINE_MS and deadline_fallbacks == 0),
        ),
        (
            "P4 at 200 %: worker tree RSS, max vs start of the level",
            "n/a" if rss_start is None else f"{rss_start / MB:,.0f} MB",
            "n/a" if rss_max is None else f"{rss_max / MB:,.0f} MB",
            "n/a" if rss_ratio is None else f"{rss_ratio:.2f}x",
            f"≤ {1 + RSS_TOLERANCE:.2f}x (flat)",
            _met(rss_ratio is not None and rss_ratio <= 1 + RSS_TOLERANCE),
        ),
        (
            "P4 at 200 %: fallback rate",
            f"{at200['results']:,} results",
            f"{at200['fallback_rate']:.1%} ({_reasons(at200['fallbacks'])})",
            "-",
            "reported",
            "-",
        ),
        (
            "P4 all levels: inputs without a result or dead letter; duplicates",
            f"{p4['inputs']:,} inputs",
            f"{p4['lost']} lost, {p4['duplicates']} duplicates, {p4['unprocessed']} unprocessed at the end",
            f"{p4['lost'] / max(1, p4['inputs']):.2%} lost",
            "0 lost",
            _met(p4["lost"] == 0),
        ),
        *_p5_rows(figures["p5"]),
        *_p6_rows(figures["p6"]),
        *(_p7_rows(figures["p7"]) if "p7" in figures else []),
    ]


def _header(figures: dict[str, Any]) -> list[str]:
    box = figures["machine"]
    return [
        f"# `make bench` ({figures['mode']} mode)",
        "",
        f"Command: `{figures['command']}`  ",
        f"Machine: {box['cores']} cores, {box['cpu']}, Python {box['python']}, "
        f"load average at start {box['load_average_at_start']}, {box['date']}  ",
        f"Broker: {figures['broker']}; sizes: {figures['sizes']}",
        "",
        "| figure | baseline | measured | ratio | goal | met? |",
        "|---|---|---|---|---|---|",
    ]


def markdown(figures: dict[str, Any]) -> str:
    lines = [
        *_header(figures),
        *("| " + " | ".join(row) + " |" for row in rows(figures)),
        "",
        HOW,
        "",
        "P4 per load level (latency = output record timestamp - input record timestamp):",
        "",
        "| load | offered | results | p50 | p95 | p99 | fallbacks | in-flight peak | tree RSS max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for level in figures["p4"]["levels"]:
        rss = level["rss_max_bytes"]
        lines.append(
            f"| {level['load_pct']} % | {level['offered_rate']:,.1f}/s | {level['results']:,} "
            f"| {_ms(level['p50_ms'])} | {_ms(level['p95_ms'])} | {_ms(level['p99_ms'])} "
            f"| {_reasons(level['fallbacks'])} | {level['in_flight_peak']} "
            f"| {'n/a' if rss is None else f'{rss / MB:,.0f} MB'} |"
        )
    p5 = figures["p5"]
    lines += [
        "",
        f"P5 per level (capacity {p5['capacity']:,.1f} tickets/s, {p5['seconds_per_level']:g} s per level):",
        "",
        "| load | scheduling | tickets | missed: tight / loose | of them classified late "
        "| classified in time | other fallbacks | lost, duplicates |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("fifo", "edf"):
        run = p5[mode]
        for level in run["levels"]:
            lines.append(
                f"| {level['load_pct']} % | {mode} | {level['tickets']:,} "
                f"| {level['missed_tight']:,} / {level['missed_loose']:,} | {level['late']:,} "
                f"| {level['in_time']:,} | {level['other']:,} | {run['lost']}, {run['duplicates']} |"
            )
    p6 = figures["p6"]
    lines += [
        "",
        f"P6 ({p6['tickets']:,} tickets for throughput; latency at {p6['offered_rate']:,.1f} tickets/s for "
        f"{p6['seconds']:g} s; latency = input record timestamp → result received by a read_committed "
        "reader):",
        "",
        "| guarantee | throughput | latency tickets | p50 | p99 | transactions (aborted) | lost "
        "| duplicates |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("at_least_once", "exactly_once"):
        run = p6[mode]
        count, aborted = run["transactions"], run["transactions_aborted"]
        transactions = f"{count:,} ({aborted})" if count else "-"
        lines.append(
            f"| {mode} | {run['throughput']['rate']:,.1f}/s | {run['latency']['visible']:,} "
            f"| {_ms(run['latency']['p50_ms'])} | {_ms(run['latency']['p99_ms'])} "
            f"| {transactions} | {run['lost']} | {run['duplicates']} |"
        )
    lines += ["", P6_WHY]
    if "p7" in figures:
        lines += ["", P7_HOW]
    lines += ["", "![latency vs load](bench-latency.png)", "", "![RSS and in-flight](bench-timeline.png)", ""]
    return "\n".join(lines)


def plots(figures: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p4 = figures["p4"]
    levels = p4["levels"]
    loads = [level["load_pct"] for level in levels]
    figure, axis = plt.subplots(figsize=(7, 4))
    for key, label in (("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99")):
        axis.plot(loads, [level[key] for level in levels], marker="o", label=label)
    axis.axhline(DEADLINE_MS, color="red", linestyle="--", label="deadline")
    axis.set_xlabel(f"offered load, % of capacity ({p4['capacity']:.0f} tickets/s)")
    axis.set_ylabel("latency, ms")
    axis.set_yscale("log")
    axis.set_title("Latency under load (input → result record timestamps)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "bench-latency.png", dpi=100)
    plt.close(figure)

    origin = levels[0]["began"]
    figure, (rss_axis, flight_axis) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    samples = p4["rss_samples"]
    rss_axis.plot([t - origin for t, _ in samples], [r / MB for _, r in samples], label="worker tree")
    metrics = p4["metrics"]
    rss_axis.plot(
        [m["t"] - origin for m in metrics], [m["rss_bytes"] / MB for m in metrics], label="main process"
    )
    rss_axis.set_ylabel("RSS, MB")
    rss_axis.legend()
    flight_axis.plot([m["t"] - origin for m in metrics], [m["in_flight"] for m in metrics], label="in flight")
    flight_axis.set_ylabel("tickets in flight")
    flight_axis.set_xlabel("seconds")
    for level in levels:
        for axis in (rss_axis, flight_axis):
            axis.axvspan(level["began"] - origin, level["produced_until"] - origin, alpha=0.08, color="C2")
        flight_axis.text(level["began"] - origin, 0, f"{level['load_pct']}%", fontsize=8, va="bottom")
    rss_axis.set_title("Worker memory and in-flight tickets (shaded: load level producing)")
    figure.tight_layout()
    figure.savefig(out / "bench-timeline.png", dpi=100)
    plt.close(figure)


def write_only(figures: dict[str, Any], out: Path, figure: str) -> None:
    """A run of one figure (`python -m tools.bench --only`): bench-<figure>.json and .md beside the full
    run's files."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench-{figure}.json").write_text(json.dumps(figures, indent=1) + "\n")
    figure_rows, how = (
        ([_p2_row(figures["p2"]), *_classify_rows(figures["p2"])], HOW)
        if figure == "p2"
        else (_p7_rows(figures["p7"]), P7_HOW)
    )
    table = ["| " + " | ".join(row) + " |" for row in figure_rows]
    (out / f"bench-{figure}.md").write_text("\n".join([*_header(figures), *table, "", how, ""]))


def write(figures: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(figures, indent=1) + "\n")
    (out / "bench.md").write_text(markdown(figures))
    plots(figures, out)
