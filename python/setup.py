"""Build hook: generates the gRPC stubs of attnserve.v1 from the .proto files.

The wire contract lives in the repository's proto/ folder (one source of truth
for C++ and Python). At build time, `build_py` runs grpcio-tools' protoc on
every proto/attnserve/v1/*.proto and writes attnserve/v1/<name>_pb2.py,
_pb2.pyi and _pb2_grpc.py into the build tree, so a new .proto (the K/V API's
kv.proto) becomes attnserve.v1.kv_pb2 without touching this file.

It also builds attnserve._native (src/attnserve/_native.cc: the tensor-carrying
unary calls through gRPC C++) when `pkg-config grpc++` finds gRPC C++'s
development files (scripts/install-deps.sh installs them) and $ATTNSERVE_NATIVE
is not 0. Without them the package is pure Python and every call goes through
grpcio; attnserve._transport is where the client chooses at run time.

Where the .proto files are found, first hit wins:
  1. $ATTNSERVE_PROTO_DIR (a folder holding attnserve/v1/*.proto);
  2. python/proto/ (an sdist made by `sdist` below vendors them there);
  3. ../proto relative to this file (`pip install ./python` from the repository).
"""

import glob
import os
import shlex
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_PROTO_DIR = os.path.join("attnserve", "v1")


def find_proto_root() -> str:
    candidates = [os.environ.get("ATTNSERVE_PROTO_DIR", ""),
                  os.path.join(HERE, "proto"),
                  os.path.join(HERE, os.pardir, "proto")]
    for root in candidates:
        if root and glob.glob(os.path.join(root, PACKAGE_PROTO_DIR, "*.proto")):
            return os.path.abspath(root)
    raise RuntimeError("attnserve: no attnserve/v1/*.proto found in $ATTNSERVE_PROTO_DIR, "
                       f"{candidates[1]} or {candidates[2]}; build from the repository "
                       "(pip install ./python) or from an sdist")


def generate_stubs(out_dir: str) -> list:
    """Runs protoc (from grpcio-tools) on attnserve/v1/*.proto into out_dir."""
    from grpc_tools import protoc  # a build requirement (pyproject.toml)
    import importlib.resources

    root = find_proto_root()
    protos = sorted(glob.glob(os.path.join(root, PACKAGE_PROTO_DIR, "*.proto")))
    # grpcio-tools ships the well-known types (google/protobuf/*.proto).
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"] + protos
    if protoc.main(args) != 0:
        raise RuntimeError(f"attnserve: protoc failed on {protos}")
    return protos


class BuildPyWithStubs(build_py):
    """build_py, then the generated stubs into the same build tree."""

    def run(self):
        super().run()
        protos = generate_stubs(self.build_lib)
        self.announce(f"attnserve: generated stubs for {len(protos)} .proto files", level=2)


class SdistWithProtos(sdist):
    """An sdist carries the .proto files (python/proto/), since ../proto is not in it."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        root = find_proto_root()
        for proto in glob.glob(os.path.join(root, PACKAGE_PROTO_DIR, "*.proto")):
            dest = os.path.join(base_dir, "proto", os.path.relpath(proto, root))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(proto, dest)


def native_extensions() -> list:
    """[attnserve._native] where gRPC C++ can be compiled against, else [] (see above)."""
    if os.environ.get("ATTNSERVE_NATIVE", "") == "0":
        return []
    try:
        cflags, libs = (shlex.split(subprocess.run(
            ["pkg-config", flag, "grpc++"], check=True, capture_output=True, text=True).stdout)
            for flag in ("--cflags", "--libs"))
    except (OSError, subprocess.CalledProcessError):
        print("attnserve: no gRPC C++ development files (pkg-config grpc++): building without "
              "attnserve._native; every call goes through grpcio")
        return []
    return [Extension("attnserve._native", sources=["src/attnserve/_native.cc"], language="c++",
                      extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", *cflags],
                      extra_link_args=libs)]


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos},
      ext_modules=native_extensions())
