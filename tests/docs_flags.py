"""The defaults of train.py's, infer.py's and tools/plan.py's flags as their parsers define them, and the
flag tables of the docs/guide pages that state them.

A guide page's flags table is the markdown table under its `## Flags and defaults` heading;
each row is `| `--flag` | default | what |` with the default written by `default_text` (a
flag of both programs names the program: `| `--tp` (infer.py) | ... |`)."""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from launch import REPO

HEADING = "## Flags and defaults"
ROW = re.compile(r"^\|\s*`(--[a-z0-9-]+)`(?:\s*\((train\.py|infer\.py|tools/plan\.py)\))?\s*\|\s*(.*?)\s*\|")


def default_text(value) -> str:
    """How a table writes a default: `on` / `off` for switches, `-` for unset (the model
    file's value or one derived from others), else the value in backticks."""
    if value is None or value == [] or value is argparse.SUPPRESS:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return f"`{value}`"


def train_flags() -> dict[str, tuple[object, str]]:
    """train.py's flags: {--flag: (default, help)}; defaults are ModelConfig / TrainConfig's
    (a --model file or --config run file may set others)."""
    from models.config import ModelConfig
    from run_config.train_config import TrainConfig
    from training.arguments import build_parser

    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else
                         f.default_factory() if f.default_factory is not dataclasses.MISSING
                         else None)
                for cls in (ModelConfig, TrainConfig) for f in dataclasses.fields(cls)}
    out = {}
    for action in build_parser()._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and not opt.startswith("--no-") and opt != "--help":
                out[opt] = (defaults.get(action.dest), action.help or "")
    return out


def _argparse_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[object, str]]:
    return {opt: (action.default, action.help or "") for action in parser._actions
            for opt in action.option_strings
            if opt.startswith("--") and not opt.startswith("--no-") and opt != "--help"}


def infer_flags() -> dict[str, tuple[object, str]]:
    """infer.py's flags: {--flag: (default, help)}."""
    sys.path.insert(0, str(REPO))
    import infer

    return _argparse_flags(infer.build_parser())


def plan_flags() -> dict[str, tuple[object, str]]:
    """tools/plan.py's flags: {--flag: (default, help)}."""
    from tools.plan import build_parser

    return _argparse_flags(build_parser())


def program_flags() -> dict[str, dict[str, tuple[object, str]]]:
    return {"train.py": train_flags(), "infer.py": infer_flags(), "tools/plan.py": plan_flags()}


def flag_rows(path: Path) -> list[tuple[int, str, str | None, str]]:
    """(line, flag, program or None, default cell) for each row of the page's flags table;
    [] when the page has no `## Flags and defaults` section."""
    lines = path.read_text().splitlines()
    rows, inside = [], False
    for i, line in enumerate(lines, 1):
        if line.startswith("## "):
            inside = line.strip() == HEADING
            continue
        m = ROW.match(line) if inside else None
        if m:
            rows.append((i, m.group(1), m.group(2), m.group(3)))
    return rows
