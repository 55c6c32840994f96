"""The Python examples of README.md, docs/python.md and docs/masks.md run as written, against a real CPU server.

Each file's ```python blocks run in order in one namespace, as a reader runs
them (a later block may continue an earlier one, as the text says). The one
change: the documented address 127.0.0.1:50051 becomes the test server's (a
free port; a fixed one would collide with other tests). A print(...) with a
trailing comment must print that comment's text (the examples' promised
output), except a comment ending in "..." (a description).
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTED_TARGET = "127.0.0.1:50051"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_PROMISE = re.compile(r"^\s*print\(.*\)\s+#\s*(.+)$")


def python_blocks(doc: str):
    return _BLOCK.findall((ROOT / doc).read_text())


@pytest.fixture(autouse=True)
def one_torch_thread():
    # As in test_hf.py: torch's OpenMP threads spin on a loaded 2-core machine.
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("doc", ["README.md", "docs/python.md", "docs/masks.md"])
def test_examples_run_as_written(server, doc):
    blocks = python_blocks(doc)
    assert blocks, f"no ```python blocks in {doc}"
    assert all(DOCUMENTED_TARGET in b for b in blocks if "attnserve" in b and "Client(" in b)
    namespace = {"__name__": "__main__"}
    for i, block in enumerate(blocks, 1):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.replace(DOCUMENTED_TARGET, server.target),
                         f"{doc}, python block {i}", "exec"), namespace)
        printed = out.getvalue()
        for line in block.splitlines():
            m = _PROMISE.match(line)
            if m and not m.group(1).rstrip().endswith("..."):
                assert m.group(1).strip() in printed, (
                    f"{doc}, python block {i}: printed {printed!r}, the comment promises "
                    f"{m.group(1).strip()!r}")
