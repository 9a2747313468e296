"""The sanitizer build of the three cffi modules (rings._virtq, virtio._net, vhost._net) for fuzzing.

Separate from the package build, which it never touches: the same sources and cdefs (each package's
``_build.py``), compiled by clang with AddressSanitizer, UBSan (every check fatal) and libFuzzer's coverage
instrumentation (``-fsanitize=fuzzer-no-link``), into a per-user cache directory keyed by a hash of the
sources, the flags and the compiler. The sanitizer runtime is not linked in: fuzz/run.py preloads the one
atheris ships (asan_with_fuzzer.so: ASan + UBSan handlers + libFuzzer), so that the C code's coverage
counters feed the same libFuzzer that drives the Python target.
"""
import contextlib
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ("rings._virtq", "virtio._net", "vhost._net")
CC = os.environ.get("VRING_FUZZ_CC", "clang")
SAN_FLAGS = ["-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
             "-fsanitize=fuzzer-no-link"]
OPT = "-O1"


def _sources():
    pats = ("rings/csrc/*.h", "virtio/csrc/*.h", "vhost/csrc/*.h", "rings/_build.py", "virtio/_build.py",
            "vhost/_build.py", "fuzz/build.py")
    return sorted(p for pat in pats for p in glob.glob(os.path.join(ROOT, pat)))


def _key():
    h = hashlib.sha256()
    for p in _sources():
        h.update(os.path.relpath(p, ROOT).encode())
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(" ".join([CC, OPT, *SAN_FLAGS, sys.version]).encode())
    try:
        h.update(subprocess.run([CC, "--version"], capture_output=True, check=True).stdout)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"fuzz: the sanitizer build needs clang ({CC}): {e}") from None
    return h.hexdigest()[:16]


def cache_root():
    """A private per-user directory for builds and working corpora."""
    d = os.path.join(tempfile.gettempdir(), f"vring-fuzz-{os.geteuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SystemExit(f"fuzz: {d} is not a private directory of this user")
    return d


def _builders():
    sys.path.insert(0, ROOT)
    from rings import _build as rings_build
    from vhost import _build as vhost_build
    from virtio import _build as virtio_build
    kw = dict(opt=OPT, extra_compile_args=SAN_FLAGS, extra_link_args=SAN_FLAGS)
    return [rings_build.rings_ffi(**kw), virtio_build.build_ffi(**kw), vhost_build.build_ffi(**kw)]


@contextlib.contextmanager
def _compiler_env():
    saved = {k: os.environ.get(k) for k in ("CC", "LDSHARED", "CFLAGS", "LDFLAGS", "CPPFLAGS")}
    os.environ.update(CC=CC, LDSHARED=f"{CC} -shared", CFLAGS="", LDFLAGS="", CPPFLAGS="")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def module_paths(directory):
    out = {}
    for name in MODULES:
        pkg, mod = name.split(".")
        found = glob.glob(os.path.join(directory, pkg, f"{mod}.*.so"))
        if not found:
            return None
        out[name] = found[0]
    return out


def build(verbose=False):
    """The directory of the sanitized modules (built now unless an up-to-date build exists). Builds of other
    sources unused for a day are removed."""
    dest = os.path.join(cache_root(), "build-" + _key())
    if module_paths(dest):
        os.utime(dest)
        return dest
    for old in glob.glob(os.path.join(cache_root(), "build-*")):
        try:
            if time.time() - os.stat(old).st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    tmp = tempfile.mkdtemp(prefix="build-", dir=cache_root())
    try:
        with _compiler_env():
            for ffi in _builders():
                ffi.compile(tmpdir=tmp, verbose=verbose)
        if not module_paths(tmp):
            raise SystemExit(f"fuzz: the sanitizer build left no modules in {tmp}")
        try:
            os.rename(tmp, dest)
        except OSError:   # built concurrently by another run: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def install(directory):
    """Load the sanitized modules under their package names, before anything imports the normal ones."""
    for name, path in module_paths(directory).items():
        if name in sys.modules:
            raise RuntimeError(f"{name} was imported before the sanitized build was installed")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod


if __name__ == "__main__":
    print(build(verbose="-v" in sys.argv))
