"""The kernel's small files, read and written in single system calls."""

from __future__ import annotations

import os
import subprocess

import pytest

from batchrun import kernel_files


def test_a_read_returns_a_file_longer_than_one_chunk_whole(tmp_path):
    path = tmp_path / "procs"
    data = b"".join(b"%d\n" % pid for pid in range(40_000))     # a busy cgroup.procs, over 64 KiB
    path.write_bytes(data)
    assert kernel_files.read(path) == data


def test_a_read_of_a_proc_file_sees_what_the_kernel_says():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert str(child.pid).encode() in kernel_files.read(f"/proc/{os.getpid()}/task/{os.getpid()}/children").split()
    finally:
        child.kill()
        child.wait()


def test_a_write_never_creates_a_file_that_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        kernel_files.write(tmp_path / "memory.memsw.limit_in_bytes", "-1")
    assert not (tmp_path / "memory.memsw.limit_in_bytes").exists()


def test_a_write_leaves_no_descriptor_open(tmp_path):
    path = tmp_path / "setting"
    path.write_text("")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(100):
        kernel_files.write(path, "1")
        kernel_files.read(path)
    assert len(os.listdir("/proc/self/fd")) == before
