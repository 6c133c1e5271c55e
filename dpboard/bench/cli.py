"""``dpboard bench TOPIC``: each topic's figures beside its baseline, measured in one run.

Every topic takes the same two options, ``--quick`` (a smoke run) and ``--json FILE`` (the figures as
JSON); ``dpboard bench TOPIC --help`` lists a topic's own. ``dpboard bench all`` runs every topic with
its defaults, and its ``--json FILE`` writes one document holding each topic's figures under its name.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile

from dpboard.bench.stats import add_common_arguments, write_json

TOPICS = {
    "board": "publish and read latency of the board vs an msgpack+flock board",
    "kernels": "loads from KV page tables: every backend vs the NumPy reference",
    "dispatch": "one dispatch decision and batches vs a pure-Python budget",
    "relay": "write-to-visible latency through relay and collector",
    "engine": "vLLM engine step: dpboard's publish beside vLLM's own step, at 0 to 10,000 waiting",
    "sglang_loads": "SGLang's own get_loads by waiting requests, beside the board write",
    "startup": "start-up of ls, info, clean and doctor --json beside python -c pass",
    "steps": "the step recorder (DPBOARD_STEP_LOG): its hooks' cost per step, beside vLLM's step and bare hooks",
}


def _topics_text() -> str:
    width = max(map(len, TOPICS))
    lines = [f"  {k:<{width}}  {v}" for k, v in TOPICS.items()]
    lines.append(f"  {'all':<{width}}  every topic above in turn, with its defaults")
    return "topics:\n" + "\n".join(lines) + "\n\nEach topic takes --quick and --json FILE; 'dpboard bench TOPIC --help' lists the rest."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _topics_text()
    p.add_argument("topic", nargs="?", choices=[*TOPICS, "all"], metavar="TOPIC",
                   help="what to measure: " + ", ".join([*TOPICS, "all"]))
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the topic's options (e.g. --quick)")


def _all_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpboard bench all", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Run every topic in turn (" + ", ".join(TOPICS) + ").",
                                epilog=_topics_text())
    add_common_arguments(p, "every topic's smoke run")
    return p


def run(args: argparse.Namespace) -> int:
    if args.topic is None:
        print("usage: dpboard bench TOPIC [--quick] [--json FILE] [...]\n\n" + _topics_text())
        return 2
    if args.topic != "all":
        return importlib.import_module(f"dpboard.bench.{args.topic}").main(list(args.rest))
    opts = _all_parser().parse_args(list(args.rest))
    status = 0
    doc: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="dpboard-bench-") as tmp:
        for topic in TOPICS:
            argv = ["--quick"] if opts.quick else []
            part = os.path.join(tmp, f"{topic}.json")
            if opts.json:
                argv += ["--json", part]
            status |= importlib.import_module(f"dpboard.bench.{topic}").main(argv)
            print()
            if opts.json and os.path.exists(part):
                with open(part) as f:
                    doc[topic] = json.load(f)
    write_json(opts.json, doc)
    return status
