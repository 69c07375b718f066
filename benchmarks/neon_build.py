"""Compile the kernels' NEON build for aarch64 on x86: proof that the source builds for ARM, not that it runs.

Usage: pip install --target /tmp/zig ziglang; PYTHONPATH=/tmp/zig python benchmarks/neon_build.py [--objdump PATH]

Zig's bundled clang cross-compiles ``cpu_kernels.SOURCE`` (without the Python bindings torch adds) with the NEON
build's flags for a generic ARMv8.2 core with SDOT, against torch's and Python's headers (OpenMP's header is a stub of
declarations: the object is compiled, not linked). With ``--objdump`` (LLVM's llvm-objdump) it counts the SDOT and
fused multiply-add instructions in the object.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from torch.utils.cpp_extension import include_paths

from specdec.models import cpu_kernels

OMP_STUB = (
    'extern "C" { int omp_get_max_threads(void); int omp_get_thread_num(void); int omp_get_num_threads(void); '
    "int omp_in_parallel(void); void omp_set_num_threads(int); }\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objdump", help="llvm-objdump, to count the SDOT instructions")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specdec-neon-"))
    (work / "omp.h").write_text("#pragma once\n" + OMP_STUB)
    (work / "kernels.cpp").write_text(cpu_kernels.SOURCE)
    flags = ["-mcpu=generic+dotprod"]  # zig's spelling of VARIANTS["neon"]'s -march=armv8.2-a+dotprod
    includes = [f"-I{work}", *(f"-I{path}" for path in include_paths()), f"-I{sysconfig.get_paths()['include']}"]
    command = [
        sys.executable,
        "-m",
        "ziglang",
        "c++",
        "-target",
        "aarch64-linux-gnu",
        *flags,
        "-O3",
        "-std=c++17",
        "-ffp-contract=off",
        "-fopenmp",
        *includes,
        "-c",
        str(work / "kernels.cpp"),
        "-o",
        str(work / "kernels.o"),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    print(
        f"aarch64 compile: {'ok' if done.returncode == 0 else 'failed'} ({len(errors)} errors)", *errors[:10], sep="\n"
    )
    if done.returncode == 0 and args.objdump:
        listing = subprocess.run(
            [args.objdump, "-d", "--mattr=+dotprod", str(work / "kernels.o")], capture_output=True, text=True
        )
        words = listing.stdout.split()
        print(f"sdot: {words.count('sdot')}, fmla: {words.count('fmla')}, fdiv: {words.count('fdiv')}")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
