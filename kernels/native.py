"""Build and load Baton's native CPU kernels (``csrc/*.c``) with the system C compiler.

Each kernel is compiled once into ``$BATON_CACHE_DIR/kernels`` (about a second) for the CPU it runs
on (``-march=native``) and cached by a hash of its source, the compiler, the flags and that CPU's
instruction sets; the file's name starts with the widest of them (``quant_linear-avx512-…so``).
A cache (or an image) built on another CPU is therefore never loaded here: the kernel is built
again for this one, instead of dying on an instruction this CPU lacks (SIGILL).
``BATON_NATIVE=0`` turns every native kernel off (the engine then uses its torch code paths);
without a compiler :func:`build` returns ``None`` too.

Kernels that use OpenMP link ``libgomp.so.1``: PyTorch has loaded its own copy of that library by
the time a kernel loads, so the dynamic linker hands the kernel the same one and they share a
thread pool instead of two pools fighting over the cores.

A kernel is compiled and linked in two steps: linking with ``-ffast-math`` (some kernels compile
with it) adds ``crtfastmath.o``, whose constructor turns on flush-to-zero and denormals-are-zero
for the whole process the moment the library loads, changing every torch result that passes
through a subnormal.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC"]
# the instruction-set families named in a cached kernel's file, widest first
_ISA_NAMES = (("avx512f", "avx512"), ("avx2", "avx2"), ("avx", "avx"), ("sse4_2", "sse4"))


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (Linux /proc/cpuinfo; elsewhere the machine's name)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86 / Arm
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform

    return frozenset([platform.machine()])


def isa_tag(flags: frozenset[str]) -> str:
    """The widest vector instruction set in ``flags`` ("avx512", "avx2", ...), for file names."""
    return next((name for flag, name in _ISA_NAMES if flag in flags), "base")


def enabled() -> bool:
    return os.environ.get("BATON_NATIVE", "1") != "0"


def build(name: str, extra_flags: list[str], torch_runtime: bool = True) -> ctypes.CDLL | None:
    """Compile (once) and load ``csrc/<name>.c``. ``torch_runtime=False`` for kernels that use no
    OpenMP and must load without torch (the router's block hashing)."""
    if not enabled():
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    src = CSRC / f"{name}.c"
    flags = FLAGS + extra_flags
    compile_flags = [f for f in flags if not f.startswith("-l")]
    link_flags = ["-shared"] + [f for f in flags if f.startswith("-l") or f == "-fopenmp"]
    cpu = cpu_flags()
    tag = hashlib.sha256(src.read_bytes() + cc.encode() + " ".join(compile_flags).encode()
                         + b"|" + " ".join(link_flags).encode()
                         + b"|" + " ".join(sorted(cpu)).encode()).hexdigest()
    root = Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))
    lib = root / "kernels" / f"{name}-{isa_tag(cpu)}-{tag[:16]}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        obj = lib.with_suffix(f".{os.getpid()}.o")
        r = subprocess.run([cc, "-c", str(src), *compile_flags, "-o", str(obj)],
                           capture_output=True, text=True)
        if r.returncode == 0:
            r = subprocess.run([cc, str(obj), *link_flags, "-o", str(tmp)], capture_output=True,
                               text=True)
        obj.unlink(missing_ok=True)
        if r.returncode != 0:
            print(f"[baton] native kernel {name} failed to compile, using torch:\n{r.stderr}",
                  file=sys.stderr)
            return None
        tmp.rename(lib)
    if torch_runtime:
        import torch  # noqa: F401  (its libgomp must be loaded before ours resolves)

    return ctypes.CDLL(str(lib))
