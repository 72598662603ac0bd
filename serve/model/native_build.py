"""Build and load the native CPU forward (serve/model/native/*.cpp), one library per
instruction set, chosen at run time by what this CPU has.

`make setup` builds both variants once into the venv (`python -m serve.model.native_build`,
seconds: plain C++ with no torch headers, loaded through ctypes); a first use builds them
if they are missing or their sources changed. Where no compiler works, or the CPU has
neither AVX-512 VNNI nor AVX2, `load()` raises NativeUnavailable with the reason, and the
runner falls back to the PyTorch int4 path (serve/model/runner.py).

OSD_NATIVE_ISA picks a variant ("avx512", "avx2") or turns the library off ("off").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from infra.common.cpu import cpu_flags

SOURCE_DIR = Path(__file__).parent / "native"
SOURCES = ("forward.cpp", "amx.h", "attention.h", "gemm.h", "logits.h", "ops.h", "pool.h")
COMMON_FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-pthread",
                # Elementwise float math stays exactly as written, so every variant rounds alike.
                "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
                # Each library keeps its own thread pool and buffers: with GNU unique symbols
                # (the default), a second build loaded beside this one (osd bench forward
                # --native-lib) would share the first one's pool object, built by other code.
                "-fno-gnu-unique")
# Variants, best first: (name, compiler flags, /proc/cpuinfo flags the CPU must have).
VARIANTS = (
    ("avx512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"),
     ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c")),
    ("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
)
ISA_CODES = {"avx512": 2, "avx2": 1}
# The plain C++ path, built with no vector flags: never served (slower than PyTorch's int4
# path), but it runs on any CPU, so tests check every variant's bits against it everywhere.
REFERENCE = "scalar"


class NativeUnavailable(RuntimeError):
    """The native library cannot run here; the message says why."""


def build_dir() -> Path:
    """Inside the venv (sys.prefix), or OSD_NATIVE_DIR: one folder per source digest."""
    root = Path(os.environ.get("OSD_NATIVE_DIR") or Path(sys.prefix) / "osd-native")
    return root / source_digest()


def source_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(" ".join(COMMON_FLAGS).encode())
    return h.hexdigest()[:16]


def compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise NativeUnavailable(f"no C++ compiler ({cxx!r} not on PATH; set CXX or install g++)")
    return cxx


def supported(flags: set[str] | None = None) -> list[str]:
    """The variants this CPU can run, best first."""
    have = cpu_flags() if flags is None else flags
    return [name for name, _, need in VARIANTS if all(f in have for f in need)]


def build(name: str, out_dir: Path | None = None) -> Path:
    """Compile variant `name` (atomically: a concurrent build never sees half a file)."""
    flags = {**{n: f for n, f, _ in VARIANTS}, REFERENCE: ()}[name]
    out_dir = out_dir or build_dir()
    out = out_dir / f"libosd_{name}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
    os.close(fd)
    cmd = [compiler(), *COMMON_FLAGS, *flags, str(SOURCE_DIR / "forward.cpp"), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise NativeUnavailable(f"compiling the {name} kernels failed: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    return out


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.osd_isa.restype = ctypes.c_int
    lib.osd_forward.restype = ctypes.c_int32
    lib.osd_forward.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    try:
        lib.osd_set_prefetch.restype = None
        lib.osd_set_prefetch.argtypes = (ctypes.c_int32,)
    except AttributeError:  # an older build (osd bench forward --native-lib): it always prefetches as built
        lib.osd_set_prefetch = lambda on: None
    try:
        lib.osd_set_amx.restype = ctypes.c_int32
        lib.osd_set_amx.argtypes = (ctypes.c_int32,)
    except AttributeError:  # an older build: no AMX path
        lib.osd_set_amx = lambda rows: 0
    try:
        lib.osd_logit_stats.restype = ctypes.c_int32
        lib.osd_logit_stats.argtypes = (ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
    except AttributeError:  # an older build: PyTorch reads the logits
        lib.osd_logit_stats = None
    lib.osd_gemm.restype = None
    lib.osd_gemm.argtypes = (ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p,
                             ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)
    return lib


def load_file(path: str | os.PathLike) -> ctypes.CDLL:
    """A library built elsewhere (another checkout's, to time two builds in one run)."""
    try:
        return _bind(ctypes.CDLL(str(path)))
    except OSError as e:
        raise NativeUnavailable(f"cannot load {path}: {e}") from e


@functools.cache
def load_variant(name: str) -> ctypes.CDLL:
    """Variant `name`, built if needed; NativeUnavailable where this CPU cannot run it."""
    if name not in ISA_CODES:
        raise NativeUnavailable(f"unknown native variant {name!r}: expected one of {', '.join(ISA_CODES)}")
    if name not in supported():
        raise NativeUnavailable(f"this CPU lacks the {name} instructions the variant needs")
    lib = _bind(ctypes.CDLL(str(build(name))))
    if lib.osd_isa() != ISA_CODES[name]:
        raise NativeUnavailable(f"the {name} build compiled without its instructions (isa {lib.osd_isa()})")
    return lib


@functools.cache
def load_reference() -> ctypes.CDLL:
    """The scalar build: the bits every variant must give (tests), on any CPU."""
    lib = _bind(ctypes.CDLL(str(build(REFERENCE))))
    if lib.osd_isa() != 0:
        raise NativeUnavailable(f"the {REFERENCE} build compiled vector kernels (isa {lib.osd_isa()})")
    return lib


def load() -> ctypes.CDLL:
    """The best variant this CPU runs (or OSD_NATIVE_ISA's); NativeUnavailable says why not."""
    want = os.environ.get("OSD_NATIVE_ISA", "auto")
    if want == "off":
        raise NativeUnavailable("OSD_NATIVE_ISA=off")
    if want != "auto":
        return load_variant(want)
    names = supported()
    if not names:
        raise NativeUnavailable("this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C")
    return load_variant(names[0])


def status() -> str:
    """One line for the set-up and `osd serve`: which variant runs, or why the fallback."""
    try:
        lib = load()
    except NativeUnavailable as e:
        return f"native CPU forward unavailable ({e}); int4 targets use the PyTorch path"
    name = next(n for n, c in ISA_CODES.items() if c == lib.osd_isa())
    return f"native CPU forward: {name} kernels"


def main() -> int:
    """`make setup`: build every variant this CPU runs, and say which one serves."""
    for name in supported():
        try:
            build(name)
        except NativeUnavailable as e:
            print(f"[osd setup] {e}", file=sys.stderr)
    print(f"[osd setup] {status()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
