"""A full disk stops the run cleanly: one message, nothing already written damaged, and --resume
finishes once there is room again. The disk is real: a small tmpfs of its own holds the run
directory and TMPDIR (the default layout, where sandboxes' workspaces live beside the run's files),
and it is filled for real, so every write meets the kernel's own ENOSPC."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import resource
import shutil
import struct
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    batch_rows,
    batch_runner_command,
    cli_environment,
    endpoint_args,
    live_processes_mentioning,
    mounted_tmpfs,
    paused_cli_command,
    read_jsonl,
    run_cli,
    write_dataset,
)

from batchrun import report
from batchrun.run_dir import (
    CHECKPOINT,
    MERGE_RECORD,
    TRAJECTORIES,
    DiskFull,
    RunDirectory,
    WriteFailed,
    atomic_write_json,
)

DISK_BYTES = 8 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MB filesystem of its own, unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "disk", f"size={DISK_BYTES}") as disk:
        yield disk


def fill(disk: Path, leave: int = 0) -> Path:
    """Take every free byte of ``disk`` but about ``leave``; returns the file that holds them."""
    filler = disk / f"filler-{uuid.uuid4().hex}"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def assert_only_complete_rows(run_dir: Path) -> None:
    for path in run_dir.glob("batch_*.jsonl"):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n"), f"{path.name} ends in half a row"
        for line in data.splitlines():
            json.loads(line)


def temporary_files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if ".tmp" in path.name)


# ---------------------------------------------------------------------------------------------
# The whole run, through the real CLI


def run_on(disk: Path, endpoint, prompts: list[str], *extra: str, dataset_dir: Path):
    """The CLI with its working directory (so data/run/) and TMPDIR on ``disk``; the dataset elsewhere."""
    home = disk / "home"
    home.mkdir(exist_ok=True)
    dataset = write_dataset(dataset_dir / "dataset.jsonl", prompts)
    return run_cli(home, f"--dataset_file={dataset}", "--batch_size=10", "--run_name=run",
                   "--distribution=terminal_only", *endpoint_args(endpoint), *extra,
                   env={"TERMINAL_ENV": "local"})


def fills_the_disk_once(disk: Path) -> str:
    """A prompt whose command takes all the free space of ``disk`` the first time it runs (a file
    outside its own directory, as the unisolated local environment allows), and nothing after."""
    marker, filler = disk / "filled-once", disk / "filled-by-a-prompt"
    command = f"test -e {marker} || (touch {marker}; cat /dev/zero > {filler}); true"
    return f"[[call terminal {json.dumps({'command': command})}]] fill the disk"


def test_a_prompt_that_fills_the_disk_stops_the_run_with_one_message_and_every_earlier_row_kept(
        small_disk, endpoint, tmp_path):
    prompts = ["question 0", "question 1", fills_the_disk_once(small_disk), "question 3"]
    result = run_on(small_disk, endpoint, prompts, "--num_workers=1", dataset_dir=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    assert result.stderr.count("error:") == 1, result.stderr
    message = result.stderr
    assert "no space left" in message.lower()
    assert "data/run/batch_0.jsonl" in message
    assert str(small_disk) in message and "tmpfs" in message       # which filesystem
    assert "free" in message and "--resume" in message
    run_dir = small_disk / "home" / "data" / "run"
    assert_only_complete_rows(run_dir)
    assert sorted(row["prompt_index"] for row in batch_rows(run_dir)) == [0, 1]
    assert temporary_files(run_dir) == []


def test_resume_on_a_still_full_disk_stops_the_same_clean_way_and_finishes_once_there_is_room(
        small_disk, endpoint, tmp_path):
    prompts = ["question 0", fills_the_disk_once(small_disk), "question 2", "question 3"]
    run_on(small_disk, endpoint, prompts, "--num_workers=1", dataset_dir=tmp_path)
    run_dir = small_disk / "home" / "data" / "run"
    before = {path.name: path.read_bytes() for path in run_dir.glob("batch_*.jsonl")}

    again = run_on(small_disk, endpoint, prompts, "--num_workers=1", "--resume", dataset_dir=tmp_path)
    assert again.returncode == 1, again.stdout + again.stderr
    assert "Traceback" not in again.stdout + again.stderr
    assert again.stderr.count("error:") == 1 and "no space left" in again.stderr.lower()
    assert {path.name: path.read_bytes() for path in run_dir.glob("batch_*.jsonl")} == before

    (small_disk / "filled-by-a-prompt").unlink()
    finished = run_on(small_disk, endpoint, prompts, "--num_workers=1", "--resume", dataset_dir=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert sorted(row["prompt_index"] for row in read_jsonl(run_dir / TRAJECTORIES)) == [0, 1, 2, 3]
    assert sorted(row["prompt_index"] for row in batch_rows(run_dir)) == [0, 1, 2, 3]
    assert temporary_files(run_dir) == []


def test_the_sessions_in_flight_when_the_disk_fills_are_stopped_and_run_again_on_resume(
        small_disk, endpoint, tmp_path):
    marker = f"still-running-{uuid.uuid4().hex[:8]}"
    slow = f'[[call terminal {{"command": "sleep 600; echo {marker}"}}]] a long command'
    prompts = [slow, "[[sleep 0.5]] " + fills_the_disk_once(small_disk)]
    result = run_on(small_disk, endpoint, prompts, "--num_workers=2", dataset_dir=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert live_processes_mentioning(marker) == []
    assert live_processes_mentioning(str(tmp_path / "dataset.jsonl")) == []     # no worker left behind
    run_dir = small_disk / "home" / "data" / "run"
    assert_only_complete_rows(run_dir)
    assert batch_rows(run_dir) == []


def test_a_merge_that_does_not_fit_keeps_the_merged_file_and_resume_merges_once_there_is_room(
        small_disk, endpoint, tmp_path):
    prompts = [f"question {number}" for number in range(20)]
    assert run_on(small_disk, endpoint, prompts, dataset_dir=tmp_path).returncode == 0
    run_dir = small_disk / "home" / "data" / "run"
    merged = (run_dir / TRAJECTORIES).read_bytes()
    (run_dir / MERGE_RECORD).unlink()           # the next merge rewrites trajectories.jsonl whole
    filler = fill(small_disk, leave=len(merged) // 2)      # room for the checkpoint, not the merged file

    again = run_on(small_disk, endpoint, prompts, "--resume", dataset_dir=tmp_path)
    assert again.returncode == 1, again.stdout + again.stderr
    assert "Traceback" not in again.stdout + again.stderr
    assert again.stderr.count("error:") == 1 and "no space left" in again.stderr.lower()
    assert TRAJECTORIES in again.stderr
    assert (run_dir / TRAJECTORIES).read_bytes() == merged
    assert temporary_files(run_dir) == []

    filler.unlink()
    finished = run_on(small_disk, endpoint, prompts, "--resume", dataset_dir=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert (run_dir / TRAJECTORIES).read_bytes() == merged


def test_report_on_a_full_disk_says_so_in_one_line_and_keeps_the_old_page(small_disk, endpoint, tmp_path):
    assert run_on(small_disk, endpoint, ["question"], dataset_dir=tmp_path).returncode == 0
    page = small_disk / "home" / "data" / "run" / report.REPORT_FILE
    before = page.read_bytes()
    fill(small_disk)
    result = run_cli(small_disk / "home", "--report", "--run_name=run")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.count("error:") == 1 and "no space left" in result.stderr.lower()
    assert page.read_bytes() == before
    assert temporary_files(page.parent) == []


def test_an_export_on_a_full_disk_says_so_in_one_line_and_keeps_the_old_file(small_disk, endpoint, tmp_path):
    assert run_on(small_disk, endpoint, [f"question {number}" for number in range(10)],
                  dataset_dir=tmp_path).returncode == 0
    out = small_disk / "export.jsonl"
    out.write_text("the earlier export\n")
    fill(small_disk)
    result = run_cli(small_disk / "home", "--run_name=run", "--export=sharegpt", f"--out={out}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.count("error:") == 1 and "no space left" in result.stderr.lower()
    assert str(out) in result.stderr
    assert out.read_text() == "the earlier export\n"
    assert temporary_files(small_disk) == []


# ---------------------------------------------------------------------------------------------
def test_a_file_size_limit_stops_the_run_with_one_message_and_resume_finishes_without_it(endpoint, tmp_path):
    """``ulimit -f`` (or a filesystem's largest file) refuses a write as EFBIG, not ENOSPC: the same clean
    stop, in its own words."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"question {n}" for n in range(40)])
    args = [f"--dataset_file={dataset}", "--batch_size=40", "--run_name=run", "--distribution=terminal_only",
            "--num_workers=1", *endpoint_args(endpoint)]

    def file_size_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    limited = subprocess.run(batch_runner_command(*args), cwd=tmp_path,
                             env=cli_environment(tmp_path, {"TERMINAL_ENV": "local"}),
                             capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                             preexec_fn=file_size_limit)
    output = limited.stdout + limited.stderr
    assert limited.returncode == 1, output
    assert "Traceback" not in output
    assert limited.stderr.count("error:") == 1, limited.stderr
    assert "largest file" in limited.stderr and "ulimit -f" in limited.stderr and "--resume" in limited.stderr
    run_dir = tmp_path / "data" / "run"
    assert_only_complete_rows(run_dir)
    kept = len(batch_rows(run_dir))
    assert 0 < kept < 40

    finished = run_cli(tmp_path, *args, "--resume", env={"TERMINAL_ENV": "local"})
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert sorted(row["prompt_index"] for row in read_jsonl(run_dir / TRAJECTORIES)) == list(range(40))


# Each file the run rewrites, on a disk with no room for the new version


def test_a_row_that_does_not_fit_leaves_its_batch_file_as_it_was(small_disk):
    directory = RunDirectory(small_disk / "run")
    directory.path.mkdir()
    directory.append(0, b'{"first": "row"}\n')
    before = (directory.path / "batch_0.jsonl").read_bytes()
    fill(small_disk, leave=8192)                # room for the start of the next row, not all of it
    with pytest.raises(DiskFull) as raised:
        directory.append(0, b'{"row": "' + b"x" * 200_000 + b'"}\n')
    assert (directory.path / "batch_0.jsonl").read_bytes() == before
    assert raised.value.needed == 200_012


def test_a_checkpoint_that_does_not_fit_keeps_the_old_one_and_leaves_no_temporary_file(small_disk):
    path = small_disk / CHECKPOINT
    atomic_write_json(path, {"completed_prompts": 1})
    fill(small_disk)
    with pytest.raises(DiskFull):
        atomic_write_json(path, {"completed_prompts": 2, "padding": "x" * 100_000})
    assert json.loads(path.read_text()) == {"completed_prompts": 1}
    assert temporary_files(small_disk) == []


def test_the_full_disk_message_names_the_file_the_filesystem_what_is_free_and_what_was_needed(small_disk):
    fill(small_disk)
    with pytest.raises(DiskFull) as raised:
        atomic_write_json(small_disk / "statistics.json", {"padding": "x" * 300_000})
    message = str(raised.value)
    assert f"{small_disk}/statistics.json" in message
    assert f"tmpfs at {small_disk}" in message
    assert "0 bytes free of 8.0 MB" in message
    assert "needs about 293 KB" in message


def test_a_report_that_does_not_fit_keeps_the_old_page(small_disk, endpoint, tmp_path):
    assert run_on(small_disk, endpoint, ["question"], dataset_dir=tmp_path).returncode == 0
    run_dir = small_disk / "home" / "data" / "run"
    before = (run_dir / report.REPORT_FILE).read_bytes()
    fill(small_disk)
    with pytest.raises(DiskFull):
        report.write_report(run_dir)
    assert (run_dir / report.REPORT_FILE).read_bytes() == before
    assert temporary_files(run_dir) == []


# ---------------------------------------------------------------------------------------------
# Two writers of one file


@pytest.mark.parametrize("name, write", [
    (CHECKPOINT, lambda path: atomic_write_json(path, {"written": True})),
    (report.REPORT_FILE, lambda path: report.write_report(path.parent)),
])
def test_a_rewrite_does_not_use_the_temporary_name_another_writer_may_hold(tmp_path, name, write):
    """``--report`` during a run writes report.html while the run's report process may: each must
    write its own temporary file, or one renames the other's half-written page into place."""
    run_dir = tmp_path / "data" / "run"
    run_dir.mkdir(parents=True)
    target = run_dir / name
    held = target.with_name(target.name + ".tmp")
    held.mkdir()                                 # another writer's temporary file, mid-way
    write(target)
    assert target.is_file() and held.is_dir()
    assert temporary_files(run_dir) == [held.name]


def test_an_export_does_not_use_the_temporary_name_another_writer_may_hold(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["question"])
    assert run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                   "--distribution=terminal_only", *endpoint_args(endpoint),
                   env={"TERMINAL_ENV": "local"}).returncode == 0
    out = tmp_path / "export.jsonl"
    held = out.with_name(out.name + ".tmp")
    held.mkdir()
    result = run_cli(tmp_path, "--run_name=run", "--export=sharegpt", f"--out={out}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(read_jsonl(out)) == 1 and held.is_dir()


# ---------------------------------------------------------------------------------------------
# Durable before done: what a power cut after the call returns cannot take back


def test_a_row_appended_to_its_batch_file_is_synced_before_the_append_returns(tmp_path, monkeypatch):
    """README: each row is appended and fsynced the moment its prompt finishes."""
    from batchrun.run_dir import durable

    synced: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(durable.os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real_fdatasync(fd)))
    row = b'{"format": 4}\n'
    RunDirectory(tmp_path).append(0, row)
    assert synced == [len(row)]           # once, with the whole row in the file


def test_a_rewritten_file_is_synced_before_it_is_renamed_over_the_old_one(tmp_path, monkeypatch):
    """rows.md: a rewritten file is written beside itself, made durable, and renamed over the old file."""
    from batchrun.run_dir import durable

    steps: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(durable.os, "fsync", lambda fd: (steps.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(durable.os, "replace", lambda *paths: (steps.append("replace"), real_replace(*paths)))
    atomic_write_json(tmp_path / CHECKPOINT, {"written": True})
    assert steps == ["fsync", "replace", "fsync"]     # the file, then its name into place, then the directory
    assert json.loads((tmp_path / CHECKPOINT).read_text()) == {"written": True}


# ---------------------------------------------------------------------------------------------
# A disk that fails otherwise: the kernel turns a filesystem read-only when it finds an error in it


@pytest.fixture
def failing_disk(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A 32 MB ext4 of its own that goes read-only at its first error, and the file that raises one."""
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("mkfs.ext4", "e2fsck", "findmnt")):
        pytest.skip("needs root, mkfs.ext4, e2fsck and findmnt to make a disk that fails")
    image, disk = tmp_path / "ext4.img", tmp_path / "ext4"
    with image.open("wb") as made:
        made.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    disk.mkdir()
    mounted = subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {mounted.stderr.strip()}")
    try:
        device = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(disk)], capture_output=True, text=True,
                                check=True).stdout.strip()
        trigger = Path("/sys/fs/ext4") / Path(device).name / "trigger_fs_error"
        if not trigger.exists():
            pytest.skip(f"this kernel has no {trigger}")
        yield disk, trigger
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_disk_gone_read_only_mid_run_stops_it_with_one_message_and_resume_finishes_once_it_is_mended(
        failing_disk, endpoint, tmp_path):
    # Before, a traceback: only a full disk was known, and EROFS (or EIO) from a row's write went up as a bug.
    disk, trigger = failing_disk
    marker = tmp_path / "failed-once"     # not on the disk, which may lose it as it fails
    command = f"test -e {marker} || (touch {marker}; echo test > {trigger}); true"
    prompts = ["question 0", "question 1", f"[[call terminal {json.dumps({'command': command})}]] break the disk",
               "question 3"]
    result = run_on(disk, endpoint, prompts, "--num_workers=1", dataset_dir=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.count("error:") == 1, result.stderr
    assert "Read-only file system" in result.stderr and "--resume" in result.stderr
    run_dir = disk / "home" / "data" / "run"
    assert_only_complete_rows(run_dir)
    assert sorted(row["prompt_index"] for row in batch_rows(run_dir)) == [0, 1]

    image = tmp_path / "ext4.img"
    subprocess.run(["umount", str(disk)], check=True)
    subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(disk)], check=True)
    finished = run_on(disk, endpoint, prompts, "--num_workers=1", "--resume", dataset_dir=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert sorted(row["prompt_index"] for row in read_jsonl(run_dir / TRAJECTORIES)) == [0, 1, 2, 3]


def test_a_disk_out_of_inodes_says_so_not_that_bytes_are_missing(tmp_path, endpoint):
    # Before, "no space left ... has 15.9 MB free of 16.0 MB", and an estimate of the bytes still needed.
    with mounted_tmpfs(tmp_path / "disk", "size=16m,nr_inodes=400") as disk:
        marker, files = tmp_path / "filled-once", disk / "files"
        command = (f"test -e {marker} || (touch {marker}; mkdir {files}; "
                   f"for i in $(seq 1000); do touch {files}/$i 2>/dev/null || break; done); true")
        prompts = ["question 0", "question 1", f"[[call terminal {json.dumps({'command': command})}]] take the inodes",
                   "question 3"]
        result = run_on(disk, endpoint, prompts, "--num_workers=1", "--batch_size=1", dataset_dir=tmp_path)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        assert result.stderr.count("error:") == 1, result.stderr
        assert "no file can be made" in result.stderr and "inodes" in result.stderr, result.stderr
        assert "Finishing the run needs" not in result.stderr
        subprocess.run(["rm", "-rf", str(files)], check=True)
        finished = run_on(disk, endpoint, prompts, "--num_workers=1", "--batch_size=1", "--resume",
                          dataset_dir=tmp_path)
        assert finished.returncode == 0, finished.stdout + finished.stderr
        run_dir = disk / "home" / "data" / "run"
        assert sorted(row["prompt_index"] for row in read_jsonl(run_dir / TRAJECTORIES)) == [0, 1, 2, 3]


def test_the_names_of_new_batch_files_on_a_disk_gone_read_only_fail_as_the_rows_did(failing_disk):
    # A group commit that made batch_1, then met the failure: before, the sync of the new name raised the
    # filesystem's own error over the one message, and again at the stop, and the run ended in a traceback.
    disk, trigger = failing_disk
    run_dir = RunDirectory(disk / "run")
    run_dir.acquire()
    try:
        run_dir.append(1, b'{"row": 1}\n')
        trigger.write_text("test")
        with pytest.raises(WriteFailed):
            run_dir.append(2, b'{"row": 2}\n')
        with pytest.raises(WriteFailed, match="Read-only file system"):
            run_dir.sync_names()
        run_dir.sync_names()        # nothing left to sync: said once
    finally:
        run_dir.release()


# ext4's EXT4_IOC_SHUTDOWN (_IOR('X', 125, __u32)): every operation on the filesystem fails with EIO from then on,
# its reads too, as a failing disk's do. NOLOGFLUSH: at once, as a disk that stops answering.
EXT4_IOC_SHUTDOWN, EXT4_GOING_FLAGS_NOLOGFLUSH = 0x8004587D, 2


def test_an_export_whose_run_directory_fails_to_read_names_that_disk_not_the_output(failing_disk, endpoint, tmp_path):
    # Before, the failing read was taken for a write of --out: "cannot write out.jsonl: Input/output error"
    # and advice about the output's disk, which was fine.
    disk, _ = failing_disk
    finished = run_on(disk, endpoint, ["question 0", "question 1"], dataset_dir=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    go, out = tmp_path / "go", tmp_path / "out.jsonl"
    command = paused_cli_command("batchrun.export.filters", "lines_at", go, "--export=sharegpt", "--run_name=run",
                                 f"--out={out}")
    process = subprocess.Popen(command, cwd=disk / "home", env=cli_environment(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and "paused at" in process.stdout.readline()
        descriptor = os.open(disk, os.O_RDONLY)
        try:
            fcntl.ioctl(descriptor, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(descriptor)
        go.touch()
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1 and "Traceback" not in stderr, stderr
    [line] = stderr.strip().splitlines()
    assert line.startswith("error: cannot read data/run/batch_0.jsonl: Input/output error"), line
    assert "Check the disk" in line and str(out) not in line
