"""The kernel build (kernels/build.py) and loader (kernels/cpu_ops.py): root folder, key, lock,
failure marker, take-over of a dead build. The compiler is replaced by a fake here; real builds
and killed builds run in tests/engine/test_killed_start.py."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.utils.cpp_extension  # the fixtures patch its load (not imported by "import torch")

from atom.kernels import build, cpu_ops
from tests.kernels.toolchain import why_kernels_cannot_exist

COMPILER_LINE = "c++ (fake) 1.0"


@pytest.fixture
def kernels_root(tmp_path, monkeypatch) -> pathlib.Path:
    root = tmp_path / "kernels"
    monkeypatch.setenv("ATOM_KERNELS_DIR", str(root))
    return root


@pytest.fixture
def fake_compiler(monkeypatch) -> list[str]:
    """cpp_extension.load replaced by one that writes an empty library; returns the build
    folders it was called with."""
    calls: list[str] = []

    def fake_load(*, name, build_directory, is_python_module, **kwargs):
        assert not is_python_module
        calls.append(build_directory)
        pathlib.Path(build_directory, f"{name}.so").write_bytes(b"")
        return str(pathlib.Path(build_directory, f"{name}.so"))

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    return calls


@pytest.fixture
def failing_compiler(monkeypatch) -> None:
    def fake_load(**kwargs):
        raise RuntimeError("Error building extension 'atom_cpu_kernels': [1/4] c++ ...\n"
                           "fused_ops.cpp:57:3: error: expected ';' before 'auto'\n")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)


@pytest.mark.skipif(why_kernels_cannot_exist() is not None,
                    reason="the C++ kernels cannot exist here")
def test_kernels_load_where_a_compiler_and_ninja_exist():
    assert cpu_ops.load() is not None, cpu_ops.unavailable_reason()


def test_root_is_the_env_var_else_the_venv_else_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOM_KERNELS_DIR", str(tmp_path / "k"))
    assert build.root_dir() == tmp_path / "k"
    monkeypatch.delenv("ATOM_KERNELS_DIR")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert build.root_dir() == tmp_path / "atom-kernels"
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "missing"))  # not writable
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "cache"))
    assert build.root_dir() == tmp_path / "cache" / "kernels"


def test_key_follows_sources_and_compiler(monkeypatch, tmp_path, kernels_root):
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    key = build.current(COMPILER_LINE).key
    assert build.current(COMPILER_LINE).key == key
    assert build.current("c++ (fake) 2.0").key != key
    with open(csrc / "ops.h", "a") as f:  # a header edit rebuilds too
        f.write("// another version\n")
    assert build.current(COMPILER_LINE).key != key


def test_build_moves_the_library_into_place_and_removes_its_folder(kernels_root, fake_compiler):
    kb = build.current(COMPILER_LINE)
    assert build.build_library(kb) == kb.library and kb.library.exists()
    assert fake_compiler == [str(kb.tmp_folder(os.getpid()))]
    assert not list(kernels_root.glob("*.tmp-*"))
    assert build.build_library(kb) == kb.library and len(fake_compiler) == 1  # built: kept


def test_a_variant_is_keyed_by_its_flags_and_sources_and_built_beside(tmp_path, kernels_root,
                                                                      fake_compiler):
    bindings = tmp_path / "bindings.cpp"
    bindings.write_text("// one\n")
    variant = build.Variant("atom_kernels_test", (build.CSRC / "fused_moe.cpp", bindings),
                            ("-mno-avx2",))
    kb = build.current(COMPILER_LINE, variant=variant)
    assert kb.key != build.current(COMPILER_LINE).key
    other_flags = dataclasses.replace(variant, cflags=("-mno-avx512f",))
    assert build.current(COMPILER_LINE, variant=other_flags).key != kb.key
    bindings.write_text("// two\n")
    assert build.current(COMPILER_LINE, variant=variant).key != kb.key
    kb = build.current(COMPILER_LINE, variant=variant)
    assert build.build_library(kb) == kernels_root / kb.key / "atom_kernels_test.so"
    assert kb.library.exists() and len(fake_compiler) == 1


def test_a_dead_builds_folder_is_taken_over(kernels_root, fake_compiler, capsys):
    kb = build.current(COMPILER_LINE)
    stale = kb.tmp_folder(999_999)
    (stale / "sub").mkdir(parents=True)
    (stale / "lock").write_text("")  # torch's FileBaton of the killed build
    build.build_library(kb)
    assert not stale.exists() and kb.library.exists()
    assert "taking over from pid 999999" in capsys.readouterr().err


def test_a_lock_held_by_a_live_process_is_waited_for_then_taken_when_it_dies(
        kernels_root, fake_compiler, monkeypatch, capsys):
    kb = build.current(COMPILER_LINE)
    kernels_root.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys\n"
         f"fd = os.open({str(kb.lock)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.pwrite(fd, f'{os.getpid()}\\n'.encode(), 0)\n"
         "print('locked', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        monkeypatch.setattr(build, "WAIT_REPORT_S", 0.2)
        with pytest.raises(TimeoutError, match=f"pid {holder.pid}"):
            build.build_library(kb, max_wait_s=1.0)
        assert f"waiting for pid {holder.pid}, which is building" in capsys.readouterr().err
        assert not fake_compiler
        holder.send_signal(signal.SIGKILL)  # the kernel releases its flock
        holder.wait(30)
        assert build.build_library(kb, max_wait_s=30) == kb.library
        assert kb.lock.read_text() == f"{os.getpid()}\n"
    finally:
        holder.kill()
        holder.wait(30)
    fd = os.open(kb.lock, os.O_RDWR)
    try:  # released after the build
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_failed_build_is_marked_and_not_retried_at_load(kernels_root, failing_compiler,
                                                          monkeypatch, capsys):
    kb = build.current()
    with pytest.raises(build.BuildError, match="expected ';'"):
        build.build_library(kb)
    assert "error: expected ';'" in kb.log.read_text()
    assert str(kb.log) in kb.failed_marker.read_text()
    assert not list(kernels_root.glob("*.tmp-*"))

    def no_build(kb):
        raise AssertionError("a failed build must not be retried at every start")

    monkeypatch.setattr(cpu_ops, "_build_in_subprocess", no_build)
    ops, reason = cpu_ops._find_or_build()
    assert ops is None and str(kb.log) in reason

    capsys.readouterr()
    assert build.main([]) == 1  # the explicit command always retries
    err = capsys.readouterr().err
    assert "error: atom's CPU kernels failed to build" in err and str(kb.log) in err


def test_a_retry_that_succeeds_clears_the_failure(kernels_root, fake_compiler):
    kb = build.current()
    kb.folder.mkdir(parents=True)
    kb.failed_marker.write_text("the build failed\n")
    assert build.main([]) == 0
    assert kb.library.exists() and not kb.failed_marker.exists()


def test_no_compiler_is_a_warning_and_the_torch_paths(kernels_root, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert build.main([]) == 0
    assert "cannot be built here (no C++ compiler" in capsys.readouterr().err
    ops, reason = cpu_ops._find_or_build()
    assert ops is None and "no C++ compiler" in reason


def test_disabled_kernels_are_none(monkeypatch):
    monkeypatch.setenv("ATOM_DISABLE_CPP_KERNELS", "1")
    assert cpu_ops._find_or_build() == (None, "ATOM_DISABLE_CPP_KERNELS is set")
