#!/usr/bin/env python3
"""Fails when two files of the libraries define a class, struct, union or enum
of one name in one named namespace (an ODR violation once a binary links both,
as kv_client_test links the client and the server).

  scripts/check-odr.py [ROOT] [--dirs client,server,...] [--file NAME=PATH ...]

Scans the .h/.cc/.cu/.cuh files under ROOT's library folders (default: client,
common, server, backend). Definitions in an anonymous namespace are skipped
(internal linkage); so are nested types and forward declarations. --file
scans PATH as if it were the repository file NAME (to check an old version:
--file client/kv_client.h=<(git show HEAD~1:client/kv_client.h)).
"""

import argparse
import os
import re
import sys
from collections import defaultdict

EXTENSIONS = (".h", ".cc", ".cu", ".cuh")
DEFAULT_DIRS = ("client", "common", "server", "backend")

NAMESPACE_OPEN = re.compile(r"^\s*(?:inline\s+)?namespace\s*([\w:]*)\s*\{")
# A type defined at namespace scope: the codebase indents nested types, so a
# namespace-scope definition starts in column 0.
TYPE_HEAD = re.compile(
    r"^(?:template\s*<.*>\s*)?(class|struct|union|enum(?:\s+class|\s+struct)?)\s+"
    r"(?:\[\[[^\]]*\]\]\s*|alignas\([^)]*\)\s*|[A-Z_]+\s+)*(\w+)\b(?!\s*::)\s*(?:final\s*)?(?:[:{]|$)")


def strip_comments_and_strings(text):
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\\n])*'", "''", text)
    return re.sub(r"//[^\n]*", "", text)


def definitions(text):
    """Yields (namespace, name, line) for each namespace-scope type definition."""
    lines = strip_comments_and_strings(text).split("\n")
    stack = []  # one entry per open brace: a namespace name, or None
    for number, line in enumerate(lines, 1):
        opened = NAMESPACE_OPEN.match(line)
        in_namespace = all(s is not None for s in stack)
        if in_namespace and not opened:
            m = TYPE_HEAD.match(line)
            if m:
                rest = "\n".join(lines[number - 1:number + 3])
                head = rest[:rest.find("{")] if "{" in rest else rest
                if ";" not in head and "{" in rest:
                    if "" not in stack:  # not in an anonymous namespace
                        yield "::".join(stack), m.group(2), number
        for ch in line:
            if ch == "{":
                if opened and len(stack) == len([s for s in stack if s is not None]):
                    stack.append(opened.group(1))
                    opened = None
                else:
                    stack.append(None)
            elif ch == "}" and stack:
                stack.pop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(__file__), ".."))
    parser.add_argument("--dirs", default=",".join(DEFAULT_DIRS))
    parser.add_argument("--file", action="append", default=[], metavar="NAME=PATH")
    args = parser.parse_args()

    files = {}
    for folder in args.dirs.split(","):
        for dirpath, _, names in os.walk(os.path.join(args.root, folder)):
            for name in names:
                if name.endswith(EXTENSIONS):
                    path = os.path.join(dirpath, name)
                    files[os.path.relpath(path, args.root)] = path
    for spec in args.file:
        name, _, path = spec.partition("=")
        files[name] = path

    where = defaultdict(list)
    for name, path in sorted(files.items()):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for namespace, type_name, line in definitions(text):
            where[(namespace, type_name)].append(f"{name}:{line}")

    clashes = {k: v for k, v in where.items() if len({p.rsplit(":", 1)[0] for p in v}) > 1}
    for (namespace, type_name), places in sorted(clashes.items()):
        print(f"{namespace}::{type_name} defined in more than one file: {', '.join(places)}")
    if clashes:
        print(f"{len(clashes)} type(s) defined twice: rename one or move it into a namespace "
              "of its own", file=sys.stderr)
        return 1
    print(f"check-odr: {len(files)} files, {len(where)} namespace-scope types, no duplicates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
