# docs/kserve.md's perf_analyzer example for attention_kv, run as written
# (issue 27 finding 15: it failed as written): its shell block is taken from
# the document and run with bash in a scratch directory, only the names of
# this build's binaries and the test server's address put in for `attnctl`,
# `perf_analyzer`, `python3` and localhost:50051. The run must exit 0 with no
# error printed, and perf_analyzer must report its sequences. perf_analyzer
# runs its default measurement (windows until stable: about 20 s here); a
# --request-count would not do instead, as perf_analyzer's count mode ended
# sequences under its own requests (40 requests over 4 sequences of 20: "sequence
# 2 not found") where the command as written ran clean. docs/kserve.md before 522af85 (perf_analyzer reading a
# kv.json no step wrote) fails both tests.
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from test_perf_analyzer import perf_analyzer

# perf_analyzer's default measurement takes 20 s or so; more on a loaded machine.
RUN_TIMEOUT_S = 300
DOC = Path(__file__).resolve().parents[2] / "docs" / "kserve.md"


def example():
    """The ```sh block of docs/kserve.md that runs perf_analyzer on attention_kv."""
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.S)
    found = [b for b in blocks if "perf_analyzer -m attention_kv" in b]
    assert len(found) == 1, f"expected one perf_analyzer attention_kv example in {DOC}"
    return found[0]


def as_run_here(script, server, binary):
    """`script` with this build's binaries and the test server's address."""
    script = script.replace("localhost:50051", server.grpc_url)
    script = re.sub(r"^attnctl ", lambda m: "{} --target={} ".format(
        shlex.quote(os.environ["ATTNCTL_BIN"]), server.grpc_url), script, flags=re.M)
    script = re.sub(r"^perf_analyzer ", shlex.quote(str(binary)) + " ", script, flags=re.M)
    script = re.sub(r"^python3 ", shlex.quote(sys.executable) + " ", script, flags=re.M)
    return script


def test_the_documented_example_is_what_this_test_runs():
    script = example()
    # What the substitutions rely on: each command starts its line.
    for command in ("attnctl kv create", "python3 - <<", "perf_analyzer -m attention_kv"):
        assert re.search("^" + re.escape(command), script, flags=re.M), command
    assert "-u localhost:50051" in script


def test_the_documented_perf_analyzer_example_runs(server, tmp_path):
    binary, env = perf_analyzer()
    script = "set -euo pipefail\n" + as_run_here(example(), server, binary)
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=RUN_TIMEOUT_S)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"{script}\n{output}"
    assert "error" not in output.lower(), output
    assert "Sequence count:" in output, output
