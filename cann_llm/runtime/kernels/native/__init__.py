"""The native custom-op library: cann::PagedAttention (paged_attention.c), cann::SwiGlu (swiglu.c), on CPUs
with AVX-512 VNNI or AVX2 cann::MatMulInt4 (matmul_int4.c, its kernels in matmul_int4_avx512.c and
matmul_int4_avx2.c), and on CPUs with AVX-512 cann::MatMulF32 (with VBMI also cann::MatMulF28;
matmul_panels.c), inside onnxruntime,
registered by library.c.

With it a paged artifact's step is one onnxruntime session run instead of ~30 sessions taking turns with
~30 host-kernel calls (docs/performance.md#one-session-per-step). onnxruntime's wheels carry no C headers,
so ort_abi.h declares the part of its C ABI the op uses, by slot. The library is compiled once per
machine, source and compiler with the system's C compiler (`$CC`, else `cc`; `-march=native`: it runs
where it was built) into the user's cache directory (`$XDG_CACHE_HOME/cann-llm/native`), atomically, so
concurrent processes never load a half-written file. Without a compiler, or when the build fails, there
is no library and the executor falls back to the host kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from cann_llm.runtime.compatibility import cpu_features
from cann_llm.runtime.kernels.numba_cache import user_cache_dir
from cann_llm.runtime.made_once import made_once

SOURCE_DIR = Path(__file__).parent
SOURCES = ("library.c", "paged_attention.c", "swiglu.c", "matmul_int4.c", "matmul_int4_avx512.c", "matmul_int4_avx2.c",
           "matmul_panels.c", "matmul_int4.h", "native_ops.h", "ort_abi.h")
# fast math without -ffinite-math-only: masked scores are -inf, and NaN weights give NaN as numpy would
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math", "-ffp-contract=fast", "-fvisibility=hidden")


class NativeUnavailable(RuntimeError):
    """Why there is no native library on this machine (no compiler, or the build failed)."""


def c_compiler() -> str | None:
    """The system's C compiler (`$CC`, else `cc`), or None where there is none."""
    chosen = os.environ.get("CC") or "cc"
    return shutil.which(chosen)


def build_key(compiler: str, files: list[Path], flags: tuple[str, ...]) -> str:
    """A digest of what a build of `files` with `compiler` and `flags` depends on here: the files' bytes, the
    compiler and its version, the flags, the architecture and the CPU's features (a `-march=native` build
    runs only where it was built, and a home directory may be shared between machines)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    for part in (compiler, version, " ".join(flags), platform.machine(), " ".join(sorted(cpu_features()))):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def compile_shared(target: Path, command: list[str]) -> Path:
    """Run the compiler `command` (all but its `-o`) into the shared library `target`, atomically: a concurrent
    reader sees the whole file or none; raises NativeUnavailable when it fails or takes over five minutes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as partial:
        pass
    try:
        try:
            built = subprocess.run([*command, "-o", partial.name], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as error:
            raise NativeUnavailable(f"{Path(command[0]).name} took over {error.timeout:.0f} s") from error
        if built.returncode != 0:
            raise NativeUnavailable(f"{Path(command[0]).name} failed: {built.stderr.strip()[-400:]}")
        os.replace(partial.name, target)
    finally:
        if os.path.exists(partial.name):
            os.unlink(partial.name)
    return target


@functools.lru_cache(maxsize=None)
def library_path(extra_flags: tuple[str, ...] = ()) -> Path:
    """The built library (built now if this machine has none yet), `extra_flags` as in `build`; raises
    NativeUnavailable."""
    compiler = c_compiler()
    if compiler is None:
        raise NativeUnavailable("no C compiler (set CC, or install gcc)")
    key = build_key(compiler, [SOURCE_DIR / name for name in SOURCES], FLAGS + extra_flags)
    target = user_cache_dir("native") / key / "libcann_native.so"
    # processes starting together (a server's replicas, test workers) would each spend ~15 s of a core on
    # the same build: one builds, the others wait for its file
    return made_once(target, lambda: build(target, compiler, extra_flags), "build.lock")


def build(target: Path, compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the library into `target` (atomically: a concurrent reader sees the whole file or none), with
    `extra_flags` after FLAGS (e.g. `-mno-avx512f`, to build the AVX2 kernels on an AVX-512 machine);
    raises NativeUnavailable when the compiler fails."""
    units = [str(SOURCE_DIR / name) for name in SOURCES if name.endswith(".c")]
    return compile_shared(target, [compiler, *FLAGS, *extra_flags, "-I", str(SOURCE_DIR), *units, "-lm"])


MATMUL_BLOCKS = {4: (32, 64, 128), 8: (64, 128)}  # bits: block sizes (a quarter, half, one or two 64-byte pieces of a row)


def matmul_kernel(library: Path) -> int:
    """Which MatMulInt4 kernel `library` registers: 512 (AVX-512 VNNI), 256 (AVX2 and FMA) or 0 (none). The
    library says so itself, so the two can never disagree."""
    return int(ctypes.CDLL(str(library)).cann_matmul_int4_built())


@functools.lru_cache(maxsize=1)
def matmul_isa() -> int:
    """The MatMulInt4 kernel of the library here (`matmul_kernel`'s answer), 0 where there is no library."""
    try:
        return matmul_kernel(library_path())
    except (NativeUnavailable, OSError):
        return 0


def has_int8_matmul() -> bool:
    """Whether the library here registers MatMulInt4: built (-march=native) for a CPU with AVX-512 VNNI, or
    with AVX2 and FMA, by a compiler that knows them."""
    return matmul_isa() != 0


def takes_matmul(attributes: dict) -> bool:
    """Whether the native MatMulInt4 computes a node with these attributes as onnxruntime's MatMulNBits would:
    int8 activations (accuracy level 4), 4 bits in blocks of 32, 64 or 128, 8 bits in blocks of 64 or 128."""
    blocks = MATMUL_BLOCKS.get(int(attributes.get("bits", 4)), ())
    return (has_int8_matmul() and int(attributes.get("accuracy_level", 0)) == 4
            and int(attributes.get("block_size", 0)) in blocks)


@functools.lru_cache(maxsize=1)
def has_float28_matmul() -> bool:
    """Whether the library here registers MatMulF28 (cann_llm/runtime/kernels/native/matmul_panels.c: built for a CPU
    with AVX-512 VBMI); the library says so itself."""
    try:
        return bool(ctypes.CDLL(str(library_path())).cann_matmul_f28_built())
    except (NativeUnavailable, OSError):
        return False


@functools.lru_cache(maxsize=1)
def has_float32_panel_matmul() -> bool:
    """Whether the library here registers MatMulF32 (cann_llm/runtime/kernels/native/matmul_panels.c: built for a CPU
    with AVX-512); the library says so itself."""
    try:
        return bool(ctypes.CDLL(str(library_path())).cann_matmul_f32_built())
    except (NativeUnavailable, OSError):
        return False


def float32_software_prefetch(library: Path) -> bool:
    """Whether `library`'s MatMulF32 prefetches its decode streams in software on this CPU (not on AMD's Zen 4,
    or as built with -DGEMV_SOFTWARE_PREFETCH=0|1); the library says so itself."""
    return bool(ctypes.CDLL(str(library)).cann_matmul_f32_software_prefetch())


def available() -> bool:
    """Whether the library exists or can be built here."""
    try:
        library_path()
    except NativeUnavailable:
        return False
    return True
