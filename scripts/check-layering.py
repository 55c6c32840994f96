#!/usr/bin/env python3
"""Checks the layering docs/design.md §1 states, on the source tree:
  - server/core/ speaks no protocol: it includes neither front-end nor any
    protocol's messages (attnserve/v1, inference/) and names no v1:: type;
  - the front-ends are siblings: server/kserve/ includes nothing of
    server/native/ nor the native messages, and server/native/ nothing of
    server/kserve/;
  - server/shm/ (the shared-memory registry both front-ends use) includes
    neither front-end nor any protocol's messages;
  - common/ reaches up into nothing; backend/ into neither server/ nor client/.
Exits 1 listing every breach. --file PATH=SOURCE checks SOURCE's text as if it
were at PATH (for the self-test that a breach is caught).
Usage: check-layering.py ROOT [--file PATH=SOURCE ...]"""
import os
import re
import sys

# (folder, forbidden include prefixes, forbidden tokens)
RULES = [
    ("server/core/", ("server/native/", "server/kserve/", "attnserve/v1/", "inference/"), ("v1::",)),
    ("server/kserve/", ("server/native/", "attnserve/v1/"), ("v1::",)),
    ("server/native/", ("server/kserve/",), ()),
    ("server/shm/", ("server/native/", "server/kserve/", "attnserve/v1/", "inference/"), ("v1::",)),
    ("common/", ("backend/", "server/", "client/"), ()),
    ("backend/", ("server/", "client/"), ()),
]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCES = (".h", ".cc", ".cu", ".cuh")


def strip_comments(text):
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def breaches(path, text):
    found = []
    for folder, includes, tokens in RULES:
        if not path.startswith(folder):
            continue
        for inc in INCLUDE.findall(text):
            if inc.startswith(includes):
                found.append(f"{path}: includes {inc} ({folder} must not)")
        code = strip_comments(text)
        for token in tokens:
            if token in code:
                found.append(f"{path}: names {token} ({folder} must not)")
    return found


def main(argv):
    root = argv[1]
    files = {}
    for folder, _, _ in RULES:
        for dirpath, _, names in os.walk(os.path.join(root, folder)):
            for name in names:
                if name.endswith(SOURCES):
                    full = os.path.join(dirpath, name)
                    files[os.path.relpath(full, root)] = full
    args = argv[2:]
    while args:
        if args[0] != "--file" or len(args) < 2:
            sys.exit(__doc__)
        path, source = args[1].split("=", 1)
        files[path] = source
        args = args[2:]
    found = []
    for path, full in sorted(files.items()):
        with open(full, encoding="utf-8", errors="replace") as f:
            found += breaches(path, f.read())
    for line in found:
        print(line)
    print(f"check-layering: {len(files)} files, {len(found)} breaches")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
