#!/usr/bin/env python3
"""Writes docs/compose_run.json from what a containerised run left behind.

    python scripts/compose_run_report.py --cold COLD.jsonl [--warm WARM.jsonl]
        --events EVENTS.jsonl --summary SUMMARY.json [--restarts RESTARTS.json]
        --command "..." [--reference docs/results/demo-run19/summary.json] [-o docs/compose_run.json]

Inputs:
    COLD, WARM   scripts/build_images.sh --timings lines of a cold build (empty layer cache) and
                 of the same build again (warm cache): {name, image, built, build_s, size_mb}
    EVENTS       scripts/compose_up.py --events lines of the run ("up", "healthy", "all_healthy",
                 "restarted", "exited", "finished"); the run's timings are those of the last
                 session (from its last "up"), every line is copied to the output
    SUMMARY      the run folder's summary.json (sinkflex-rl train's), read from the data volume
    RESTARTS     a JSON list of the faults induced during the run: {container, action, at,
                 recovered, ...} (at: unix seconds)
    REFERENCE    a summary.json of `bin/demo` (the embedded default) for the wall-time comparison

Output (JSON): images [{name, image, built, size_mb, build_s, build_s_warm}], run {finished,
wall_s, up_to_all_healthy_s, compose_wall_s, groups_published, groups_trained, dead_letters,
validation [{after, policy_version, mean_at_1, ci_low, ci_high, tasks, trials}], buffer,
last_vs_warm_start, reference}, restarts, events, command.

Raises (exits non-zero with the message): a missing input file or one that is not JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _lines(path: Path | None) -> list[dict]:
    if path is None:
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def images(cold: list[dict], warm: list[dict]) -> list[dict]:
    """One row per image: the cold build's size and seconds, the warm build's seconds."""
    warm_by_name = {w["name"]: w for w in warm}
    out = []
    for c in cold:
        row = {"name": c["name"], "image": c["image"], "built": bool(c["built"]), "size_mb": c["size_mb"],
               "build_s": c["build_s"]}
        row.update({k: v for k, v in c.items() if k not in row and k != "started"})
        if c["name"] in warm_by_name:
            row["build_s_warm"] = warm_by_name[c["name"]]["build_s"]
            row["size_mb_warm"] = warm_by_name[c["name"]]["size_mb"]
        out.append(row)
    return out


def first_healthy(events: list[dict], up_t: float | None) -> dict[str, float]:
    """{service: seconds from "up" to its first "healthy"}."""
    out: dict[str, float] = {}
    for e in events:
        if e["event"] == "healthy" and up_t:
            out.setdefault(e["service"], round(e["t"] - up_t, 1))
    return out


def run(summary: dict, events: list[dict], steps: int | None, reference: dict | None) -> dict:
    """The run's figures: summary.json's, plus the compose timings from the events."""
    ups = [i for i, e in enumerate(events) if e["event"] == "up"]
    events = events[ups[-1]:] if ups else events  # the last `compose_up.py` session
    by = {}
    for e in events:
        by.setdefault(e["event"], e)  # the first of each
    up_t = by.get("up", {}).get("t")
    finished_event = by.get("finished")
    buffer = summary.get("buffer", {})
    out = {
        "finished": (not summary.get("interrupted", True)
                     and (steps is None or summary.get("train_steps") == steps)
                     and (finished_event is None or not any(finished_event["exit_codes"].values()))),
        "wall_s": summary.get("wall_seconds"),
        "wall_s_all_sessions": summary.get("wall_seconds_all_sessions"),
        "sessions": summary.get("sessions"),
        "up_to_all_healthy_s": round(by["all_healthy"]["t"] - up_t, 1) if up_t and "all_healthy" in by else None,
        "compose_wall_s": round(finished_event["t"] - up_t, 1) if up_t and finished_event else None,
        "healthy_after_s": first_healthy(events, up_t),
        "policy_version": summary.get("policy_version"),
        "train_steps": summary.get("train_steps"),
        "groups_published": summary.get("groups_published"),
        "groups_trained": summary.get("groups_trained"),
        "dead_letters": buffer.get("dead_letters"),
        "validation": summary.get("validation", []),
        "last_vs_warm_start": summary.get("last_vs_warm_start"),
        "buffer": buffer,
    }
    if reference:
        out["reference_bin_demo"] = {"wall_s": reference.get("wall_seconds"),
                                     "validation": reference.get("validation", [])}
    return out


def restarts(faults: list[dict], figures: dict) -> list[dict]:
    """The induced faults, each with `recovered`: its container ran and passed its health check
    again, and the run finished in the same session with every published group trained once
    and none dead-lettered."""
    run_ok = (figures["finished"] and figures.get("sessions") == 1
              and figures["groups_trained"] == figures["groups_published"] and figures["dead_letters"] == 0)
    return [{**f, "container_back": f.get("healthy_s") is not None,
             "recovered": f.get("healthy_s") is not None and bool(run_ok)} for f in faults]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", type=Path, required=True)
    parser.add_argument("--warm", type=Path)
    parser.add_argument("--events", type=Path, required=True)
    parser.add_argument("--summary", type=Path, required=True)
    parser.add_argument("--restarts", type=Path)
    parser.add_argument("--reference", type=Path)
    parser.add_argument("--steps", type=int, help="RL steps the experiment asks for (finished = all done)")
    parser.add_argument("--command", required=True)
    parser.add_argument("--note", action="append", default=[])
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/compose_run.json"))
    args = parser.parse_args(argv)
    try:
        events = _lines(args.events)
        figures = run(json.loads(args.summary.read_text()), events, args.steps,
                      json.loads(args.reference.read_text()) if args.reference else None)
        report = {
            "images": images(_lines(args.cold), _lines(args.warm)),
            "run": figures,
            "restarts": restarts(json.loads(args.restarts.read_text()) if args.restarts else [], figures),
            "events": events,
            "command": args.command,
            "notes": args.note,
        }
    except (OSError, json.JSONDecodeError, KeyError) as err:
        print(f"compose_run_report: {err}", file=sys.stderr)
        return 1
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
