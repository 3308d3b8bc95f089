"""The commands of README.md and docs/guide/ write their outputs where git does not see them:
every relative folder their examples pass to --save, --out or --output-prefix is covered by
.gitignore."""
from __future__ import annotations

import re
import subprocess

from launch import REPO


def test_readme_output_folders_are_ignored():
    text = "\n".join(p.read_text() for p in
                     [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))])
    outputs = {m.split("/")[0] for m in re.findall(
        r"--(?:save|out|output-prefix|log-dir) ([A-Za-z0-9_.][\w./-]*)", text)
        if not m.startswith("/")}
    assert {"smol", "smol-ft", "smol-ft-hf", "ckpt"} <= outputs, outputs
    proc = subprocess.run(["git", "check-ignore", "--no-index", "-v",
                           *(f"{o}/x" for o in sorted(outputs))],
                          cwd=REPO, capture_output=True, text=True)
    ignored = {line.split("\t")[1].split("/")[0] for line in proc.stdout.splitlines()}
    assert ignored == outputs, sorted(outputs - ignored)
