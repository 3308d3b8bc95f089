"""A small instruction set built from a local text: the Python standard library's docstrings,
one question/answer pair per public function or class of `MODULES` whose docstring's first
paragraph is 20-400 characters ("Question: What does textwrap.dedent do?\\nAnswer: Remove
any common leading whitespace ..."), written as JSON lines with a "text" field for
tools/preprocess_data.py (the LoRA acceptance run, docs/PERFORMANCE.md).

    python bench/stdlib_qa.py OUT.jsonl
"""
from __future__ import annotations

import importlib
import inspect
import json
import sys

MODULES = ["textwrap", "json", "os.path", "collections", "itertools", "functools", "string",
           "re", "shutil", "glob", "fnmatch", "heapq", "bisect", "statistics", "difflib",
           "base64", "csv", "random", "math", "datetime", "pathlib", "tempfile", "zipfile",
           "gzip", "hashlib", "hmac", "uuid", "copy", "pprint", "argparse", "logging",
           "subprocess", "threading", "queue", "socket", "urllib.parse", "html", "email.utils",
           "calendar", "decimal", "fractions", "operator", "contextlib", "dataclasses", "enum",
           "typing", "inspect", "ast", "tokenize", "traceback", "warnings", "weakref"]


def pairs() -> list[str]:
    """The question/answer texts, in module order, then name order."""
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)
                                            or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or getattr(obj, "__module__", name) not in (name, name.replace(".", "")):
                continue
            answer = doc.split("\n\n")[0].strip()
            if 20 <= len(answer) <= 400:
                out.append(f"Question: What does {name}.{attr} do?\nAnswer: {answer}")
    return out


if __name__ == "__main__":
    rows = pairs()
    with open(sys.argv[1], "w") as f:
        for text in rows:
            f.write(json.dumps({"text": text}) + "\n")
    print(f"{len(rows)} question/answer pairs -> {sys.argv[1]}")
