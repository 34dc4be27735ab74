"""The system-call filter every sandboxed command runs under (bwrap ``--seccomp``).

A sandbox is made fresh for every prompt, so what a command changes dies with it. Some kernel state does
not: keyrings, which the kernel keeps per user and which a process also reaches through the session keyring
it inherited from the runner; and disk space. Some is one for the whole machine, shared by every sandbox
running at once: the events of asynchronous I/O, and the files anything opens, which inotify and fanotify
report. So
the filter refuses:

* ``add_key``, ``request_key``, ``keyctl`` (EPERM): no key can be read from the runner's session keyring
  or left in a user keyring for whoever gets that uid next;
* ``fallocate`` (EOPNOTSUPP): it reserves gigabytes in one call, faster than any watch on the workspace
  can stop it. C libraries fall back to writing (``posix_fallocate``), which the workspace limit keeps up
  with;
* ``io_uring_setup`` (ENOSYS, as on a kernel without io_uring, which programs fall back from): a ring's
  IORING_OP_FALLOCATE reserves space as ``fallocate`` does, without that system call;
* ``ioctl`` with FS_IOC_RESVSP, FS_IOC_RESVSP64 or FS_IOC_ZERO_RANGE (EOPNOTSUPP), in the layout of
  either word size: the kernel serves them with ``fallocate`` on any filesystem that has it;
* ``io_setup`` (ENOSYS, as on a kernel without AIO, which libaio's users fall back from): the events of
  asynchronous I/O are one count for the whole machine (``fs.aio-max-nr``), which one prompt could take
  whole, leaving none to the prompts beside it and to the host's programs;
* ``inotify_init``, ``inotify_init1`` and ``fanotify_init`` (ENOSYS, as on a kernel without them: watchers
  such as ``tail -f`` poll instead): a watch on the read-only directories every sandbox shares (``/etc``,
  ``/usr``) sees each file other prompts, the runner and the host's programs open (fanotify needs no
  privilege for that since Linux 5.13);
* ``clone`` and ``unshare`` with CLONE_NEWUSER (EPERM), and ``clone3`` (ENOSYS, as on a kernel before it,
  which the C library falls back from to ``clone``: its flags are in memory, out of a filter's reach). In a
  user namespace of its own a command has every capability: it could mount a ``/tmp`` past its limit, and
  reach kernel code only root may (nf_tables, filesystems). A sandbox with a user namespace of its own has
  bwrap's ``--disable-userns`` too; a root run's has no user namespace, and only this.

Everything else is allowed: ``ptrace`` and friends reach only the prompt's own processes, in a PID
namespace of their own. The program is classic BPF, as the kernel takes it, checking the architecture
first so that a 32-bit or x32 system call cannot slip past under another number.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import struct

# The kernel's names (linux/audit.h, linux/seccomp.h, linux/filter.h).
_AUDIT_ARCH = {"x86_64": 0xC000003E, "i386": 0x40000003, "aarch64": 0xC00000B7, "arm": 0x40000028}
_X32_SYSCALL_BIT = 0x40000000
_X32_NUMBERS = {"ioctl": 514, "io_setup": 543}      # where x32's number is not x86_64's
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06
# In struct seccomp_data; an ioctl's request is its second argument, an int, and the flags of clone and
# unshare their first (the low words on the little-endian architectures below).
_ARCH_OFFSET, _NR_OFFSET, _FLAGS_OFFSET, _REQUEST_OFFSET = 4, 0, 16, 24
_CLONE_NEWUSER = 0x10000000

# The refused calls' numbers per architecture (asm/unistd*.h), with the error each gets.
_REFUSED = {
    "add_key": errno.EPERM, "request_key": errno.EPERM, "keyctl": errno.EPERM, "fallocate": errno.EOPNOTSUPP,
    "io_uring_setup": errno.ENOSYS, "clone3": errno.ENOSYS, "io_setup": errno.ENOSYS, "inotify_init": errno.ENOSYS,
    "inotify_init1": errno.ENOSYS, "fanotify_init": errno.ENOSYS,
}
# The ioctl requests that preallocate (linux/fs.h: _IOW('X', 40, 42 or 57, struct space_resv), which is 48
# bytes, or 44 where a 64-bit value is 4-aligned, as in 32-bit x86 programs) and the error each gets.
_REFUSED_REQUESTS = [((1 << 30) | (size << 16) | (ord("X") << 8) | number, errno.EOPNOTSUPP)
                     for number in (40, 42, 57) for size in (48, 44)]
# A call an architecture does not have (aarch64 has only inotify_init1) is left out of its table.
_NUMBERS = {
    "x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250, "fallocate": 285, "io_uring_setup": 425,
               "clone3": 435, "ioctl": 16, "clone": 56, "unshare": 272, "io_setup": 206, "inotify_init": 253,
               "inotify_init1": 294, "fanotify_init": 300},
    "i386": {"add_key": 286, "request_key": 287, "keyctl": 288, "fallocate": 324, "io_uring_setup": 425,
             "clone3": 435, "ioctl": 54, "clone": 120, "unshare": 310, "io_setup": 245, "inotify_init": 291,
             "inotify_init1": 332, "fanotify_init": 338},
    "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219, "fallocate": 47, "io_uring_setup": 425,
                "clone3": 435, "ioctl": 29, "clone": 220, "unshare": 97, "io_setup": 0, "inotify_init1": 26,
                "fanotify_init": 262},
    "arm": {"add_key": 309, "request_key": 310, "keyctl": 311, "fallocate": 352, "io_uring_setup": 425,
            "clone3": 435, "ioctl": 54, "clone": 120, "unshare": 337, "io_setup": 243, "inotify_init": 316,
            "inotify_init1": 360, "fanotify_init": 367},
}
# The architectures a process on this machine can make system calls as (64-bit hosts run 32-bit programs).
_ABIS = {"x86_64": ("x86_64", "i386"), "aarch64": ("aarch64", "arm")}


def _instruction(code: int, jump_true: int, jump_false: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jump_true, jump_false, k)


def _numbers(abi: str, name: str) -> list[int]:
    """A system call's numbers for one architecture (none where it has no such call); x32 calls on x86_64
    carry a bit of their own (and some a number of their own)."""
    if (number := _NUMBERS[abi].get(name)) is None:
        return []
    if abi != "x86_64":
        return [number]
    return [number, _X32_NUMBERS.get(name, number) | _X32_SYSCALL_BIT]


def _refusals(abi: str) -> list[tuple[int, int]]:
    """(system call number, errno) pairs for one architecture."""
    return [(number, error) for name, error in _REFUSED.items() for number in _numbers(abi, name)]


def _matches(offset: int, refused: list[tuple[int, int]]) -> list[bytes]:
    """Load the word at ``offset`` of the call's data, and fail the call with its errno if it is refused."""
    block = [_instruction(_LD_W_ABS, 0, 0, offset)]
    for value, error in refused:
        block += [_instruction(_JEQ_K, 0, 1, value), _instruction(_RET_K, 0, 0, _RET_ERRNO | error)]
    return block


# The calls refused only for what an argument says: each name's check ends by refusing or allowing the call.
_ARGUMENT_CHECKS = {
    "ioctl": [*_matches(_REQUEST_OFFSET, _REFUSED_REQUESTS), _instruction(_RET_K, 0, 0, _RET_ALLOW)],
    "clone": [_instruction(_LD_W_ABS, 0, 0, _FLAGS_OFFSET), _instruction(_JSET_K, 0, 1, _CLONE_NEWUSER),
              _instruction(_RET_K, 0, 0, _RET_ERRNO | errno.EPERM), _instruction(_RET_K, 0, 0, _RET_ALLOW)],
}
_ARGUMENT_CHECKS["unshare"] = _ARGUMENT_CHECKS["clone"]


def _checked_by_argument(abi: str) -> list[bytes]:
    """With the call's number loaded: a call checked by an argument jumps to its check, any other is allowed."""
    numbers = [(number, name) for name in _ARGUMENT_CHECKS for number in _numbers(abi, name)]
    checks: list[bytes] = []
    starts = {}
    for name, check in _ARGUMENT_CHECKS.items():
        starts[name] = len(checks)
        checks += check
    # Each jump lands past the jumps after it and the allow that ends them, at its check.
    jumps = [_instruction(_JEQ_K, len(numbers) - index + starts[name], 0, number)
             for index, (number, name) in enumerate(numbers)]
    return [*jumps, _instruction(_RET_K, 0, 0, _RET_ALLOW), *checks]


@functools.cache
def filter_program(machine: str | None = None) -> bytes | None:
    """The filter as bwrap reads it (an array of struct sock_filter), or None on a machine it does not
    know, where sandboxes run without one (the start-up summary says so)."""
    abis = _ABIS.get(machine or platform.machine())
    if abis is None:
        return None
    # Built back to front, so each jump's distance is known when it is written.
    program: list[bytes] = [_instruction(_RET_K, 0, 0, _RET_KILL_PROCESS)]   # an architecture not listed
    for abi in reversed(abis):
        block = [*_matches(_NR_OFFSET, _refusals(abi)), *_checked_by_argument(abi)]
        # Load the architecture; on a match fall into this block, else jump over it to the next check.
        program = [_instruction(_LD_W_ABS, 0, 0, _ARCH_OFFSET), _instruction(_JEQ_K, 0, len(block), _AUDIT_ARCH[abi]),
                   *block, *program]
    return b"".join(program)


def filter_descriptor(program: bytes) -> int:
    """A new descriptor holding ``program`` from its start, for one bwrap to read (each reads to the end)."""
    fd = os.memfd_create("batchrun-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


_KEYCTL_JOIN_SESSION_KEYRING = 1


def leave_session_keyring() -> None:
    """Give this process (and so every process it starts) a new, empty session keyring of its own.

    Processes inherit their parent's session keyring and may read the keys in it (a login's Kerberos
    tickets, say) whatever their uid: a worker leaves the user's before it starts any sandbox or browser.
    Where the kernel has no keyrings there is nothing to leave.
    """
    number = _NUMBERS.get(platform.machine(), {}).get("keyctl")
    if number is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(ctypes.c_long(number), ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None))
