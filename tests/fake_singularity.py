"""A stand-in for the ``singularity``/``apptainer`` CLI (see fake_container.py for how instances are
kept). The wrapper sets ``FAKE_PROGRAM`` to the name it was called by.

Understands what batchrun's singularity backend calls: pull, instance start/list/stop, exec into
``instance://NAME``. Like the real program, exec passes the host environment into the container
unless exec is given ``--cleanenv``, and even then the host's proxy variables and each variable that
``APPTAINERENV_``/``SINGULARITYENV_`` name; instance start binds what the bind variables name besides
its ``--bind`` (as Apptainer's internal/pkg/util/env/clean.go and its documented
APPTAINER_BIND/SINGULARITY_BIND do), and what the mount variables name; exec reads the file an env-file
variable names into the container's environment. ``FAKE_PULL_FAIL=img[,img]`` makes
pulling ``docker://img`` fail; ``FAKE_PULL_SECONDS`` slows pulls down.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from fake_container import Container, container_env, fail, log_call, pull_delay, pull_fails

PROGRAM = os.environ.get("FAKE_PROGRAM", "singularity")
# Options of the commands below that take a value; every other option is a flag.
VALUE_OPTIONS = {"--network", "--bind", "-B", "--pwd"}
# What --cleanenv passes all the same.
ALWAYS_PASSED = {name for variable in ("http_proxy", "https_proxy", "no_proxy", "all_proxy", "ftp_proxy")
                 for name in (variable, variable.upper())}
ENV_PREFIXES = ("APPTAINERENV_", "SINGULARITYENV_")
BIND_VARIABLES = ("APPTAINER_BIND", "APPTAINER_BINDPATH", "SINGULARITY_BIND", "SINGULARITY_BINDPATH")
# Every option can be given as <RUNTIME>_<OPTION> (cmd/internal/cli/action_flags.go): these two are acted on.
MOUNT_VARIABLES = ("APPTAINER_MOUNT", "SINGULARITY_MOUNT")
ENV_FILE_VARIABLES = ("APPTAINER_ENV_FILE", "SINGULARITY_ENV_FILE")


def options(args: list[str]) -> tuple[dict[str, str], list[str]]:
    found: dict[str, str] = {}
    position = 0
    while position < len(args) and args[position].startswith("-"):
        name = args[position]
        if name in VALUE_OPTIONS:
            found[name] = args[position + 1]
            position += 2
        else:
            found[name] = ""
            position += 1
    return found, args[position:]


def pull(args: list[str]) -> int:
    found, (target, source) = options(args)
    if Path(target).exists() and "--force" not in found:
        fail(f"FATAL:   Image file already exists: {target!r} - will not overwrite", 255)
    pull_delay()
    if pull_fails(source.removeprefix("docker://")):
        fail(f"FATAL:   While making image from oci registry: error fetching image to cache: failed to get "
             f"checksum for {source}: reading manifest latest in docker.io/{source.removeprefix('docker://')}: "
             "requested access to the resource is denied", 255)
    Path(target).write_text(f"SIF of {source}\n")
    return 0


def bind_pairs(specs: list[str]) -> list[list[str]]:
    """Each SRC[:DEST[:OPTIONS]] of the comma-separated ``specs`` -> [SRC, DEST] (DEST is SRC if not given)."""
    pairs = []
    for spec in ",".join(specs).split(","):
        if spec:
            parts = spec.split(":")
            pairs.append([parts[0], parts[1] if len(parts) > 1 else parts[0]])
    return pairs


def mount_pairs(specs: list[str]) -> list[list[str]]:
    """[SRC, DEST] of each --mount spec given (type=bind,source=SRC,destination=DEST)."""
    pairs = []
    for spec in filter(None, specs):
        fields = dict(field.split("=", 1) for field in spec.split(",") if "=" in field)
        pairs.append([fields.get("source", fields.get("src", "")), fields.get("destination", fields.get("dst", ""))])
    return pairs


def instance_start(args: list[str]) -> int:
    found, (sif, name) = options(args)
    if not Path(sif).is_file():
        fail(f"FATAL:   could not open image {sif}: failed to retrieve path for {sif}: no such file or directory",
             255)
    container = Container(name)
    if container.exists():
        fail(f"FATAL:   instance {name} already exists", 255)
    binds = bind_pairs([found.get("--bind", ""), *(os.environ.get(name, "") for name in BIND_VARIABLES)])
    binds += mount_pairs([os.environ.get(name, "") for name in MOUNT_VARIABLES])
    container.create({"sif": sif, "binds": binds, "options": sorted(found),
                      "network": found.get("--network")})
    print("INFO:    instance started successfully")
    return 0


def instance_list(args: list[str]) -> int:
    found, _ = options(args)
    instances = [{"instance": c.name, "pid": 1, "img": c.meta["sif"], "ip": "", "logErrPath": "", "logOutPath": ""}
                 for c in Container.all()]
    if "--json" in found:
        print(json.dumps({"instances": instances}, indent="\t"))
    else:
        print("INSTANCE NAME    PID    IP    IMAGE")
        for entry in instances:
            print(f"{entry['instance']}    1        {entry['img']}")
    return 0


def instance_stop(args: list[str]) -> int:
    _, [name] = options(args)
    container = Container(name)
    if not container.exists():
        fail(f"FATAL:   no instance found with name {name}", 255)
    container.remove()
    print(f"INFO:    Stopping {name} instance")
    return 0


def exec_(args: list[str]) -> int:
    found, rest = options(args)
    target, argv = rest[0], rest[1:]
    if not target.startswith("instance://"):
        fail("fake singularity: only exec into instance:// is supported")
    container = Container(target.removeprefix("instance://"))
    if not container.exists():
        fail(f"FATAL:   instance {target} does not exist", 255)
    # Each exec builds its own environment; what instance start was told does not carry over.
    env = cleaned_environment(container.host_path("/root")) if "--cleanenv" in found else dict(os.environ)
    for name in ENV_FILE_VARIABLES:         # read into the container's environment, --cleanenv or not
        if name in os.environ:
            env.update(line.split("=", 1) for line in Path(os.environ[name]).read_text().splitlines() if "=" in line)
    return container.execute(argv, workdir=found.get("--pwd", "/"), env=env, stdin=True)


def cleaned_environment(home: str) -> dict[str, str]:
    passed = {name: value for name, value in os.environ.items() if name in ALWAYS_PASSED}
    named = {name[len(prefix):]: value for name, value in os.environ.items() for prefix in ENV_PREFIXES
             if name.startswith(prefix) and len(name) > len(prefix)}
    return container_env(home, {**passed, **named})


COMMANDS = {"pull": pull, "instance start": instance_start, "instance list": instance_list,
            "instance stop": instance_stop, "exec": exec_}


def main(argv: list[str]) -> int:
    log_call(PROGRAM, argv)
    key = " ".join(argv[:2]) if argv[:1] == ["instance"] else (argv[0] if argv else "")
    command = COMMANDS.get(key)
    if command is None:
        fail(f"fake {PROGRAM}: unsupported command {json.dumps(argv)}")
    return command(argv[2:] if argv[:1] == ["instance"] else argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
