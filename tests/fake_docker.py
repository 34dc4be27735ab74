"""A stand-in for the ``docker`` CLI (see fake_container.py for how containers are kept).

Understands what batchrun's docker backend calls: version, image inspect, pull, run -d, exec,
rm -f, ps -a --filter label=K=V|name=REGEX [--format {{.Names}}]. Switches, from the environment:

- ``FAKE_DOCKER_ENGINE=down``: every call fails as the real client does without a daemon.
- ``FAKE_PULL_FAIL=img[,img]``: pulling these images fails; ``FAKE_PULL_SECONDS``: pull duration.
- ``FAKE_RUN_SECONDS``: how long ``run`` takes before the container exists; once it does, ``run``
  logs ``["created", NAME]``, so a test can tell a creation that finished from one cut short.
- ``FAKE_EXEC_IGNORES_TIMEOUT=1``: ``exec ... timeout -s KILL N ...`` runs without the ``timeout``
  (as if the image had none that works), to exercise the runner's own time limit.

Images present are files under ``$FAKE_CONTAINER_STATE/images/``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time

from fake_container import Container, container_env, fail, file_name, log_call, pull_delay, pull_fails, state

NO_ENGINE = ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
             "Is the docker daemon running?")


def image_file(image: str):
    return state() / "images" / file_name(image)


def options(args: list[str], with_value: set[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Leading options (repeatable ones collected in lists) and the remaining arguments."""
    found: dict[str, list[str]] = {}
    position = 0
    while position < len(args) and args[position].startswith("-"):
        name = args[position]
        if name in with_value:
            found.setdefault(name, []).append(args[position + 1])
            position += 2
        else:
            found.setdefault(name, []).append("")
            position += 1
    return found, args[position:]


def version(args: list[str]) -> int:
    print("28.2.2")
    return 0


def image(args: list[str]) -> int:
    if args[:1] != ["inspect"]:
        fail(f"fake docker: unsupported image command {args}")
    _, images = options(args[1:], {"--format", "-f"})
    missing = [name for name in images if not image_file(name).exists()]
    if missing:
        fail(f"Error response from daemon: No such image: {missing[0]}")
    for name in images:
        print("sha256:" + file_name(name).encode().hex()[:64])
    return 0


def pull(args: list[str]) -> int:
    [name] = args
    pull_delay()
    if pull_fails(name):
        fail(f"Error response from daemon: pull access denied for {name}, repository does not exist or "
             "may require 'docker login': denied: requested access to the resource is denied")
    image_file(name).parent.mkdir(parents=True, exist_ok=True)
    image_file(name).write_text(name)
    print(f"Status: Downloaded newer image for {name}")
    return 0


def run(args: list[str]) -> int:
    found, rest = options(args, {"--label", "--name", "--network", "-w", "--entrypoint", "--memory",
                                 "--memory-swap", "--pids-limit", "--tmpfs", "--stop-timeout", "--ulimit", "--log-driver",
                                 "--env"})
    if "-d" not in found:
        fail("fake docker: only detached runs are supported")
    time.sleep(float(os.environ.get("FAKE_RUN_SECONDS", "0")))
    name, image_name = found["--name"][0], rest[0]
    if not image_file(image_name).exists():
        fail(f"Unable to find image '{image_name}' locally\ndocker: Error response from daemon: pull access "
             f"denied for {image_name}", 125)
    container = Container(name)
    if container.exists():
        fail(f'docker: Error response from daemon: Conflict. The container name "/{name}" is already in use.', 125)
    labels = dict(label.split("=", 1) for label in found.get("--label", []))
    container_id = secrets.token_hex(32)
    workdir = found.get("-w", ["/"])[0]
    container.create({"id": container_id, "image": image_name, "labels": labels,
                      "network": found.get("--network", ["bridge"])[0], "workdir": workdir,
                      "command": found.get("--entrypoint", []) + rest[1:]})
    os.makedirs(container.host_path(workdir), exist_ok=True)    # docker run -w creates it
    log_call("docker", ["created", name])
    print(container_id)
    return 0


def find(reference: str) -> Container | None:
    for container in Container.all():
        if reference == container.name or container.meta["id"].startswith(reference):
            return container
    return None


def exec_(args: list[str]) -> int:
    found, rest = options(args, {"-w", "-e"})
    container = find(rest[0])
    if container is None:
        fail(f"Error response from daemon: No such container: {rest[0]}")
    argv = rest[1:]
    if os.environ.get("FAKE_EXEC_IGNORES_TIMEOUT") and "timeout" in argv:
        start = argv.index("timeout")
        argv = argv[:start] + argv[start + 4:]      # timeout -s KILL N
    return container.execute(argv, workdir=found.get("-w", [container.meta["workdir"]])[0],
                             env=container_env(container.host_path("/root"), {"HOSTNAME": container.name}),
                             stdin="-i" in found)


def rm(args: list[str]) -> int:
    found, references = options(args, set())
    status = 0
    for reference in references:
        container = find(reference)
        if container is None:
            print(f"Error response from daemon: No such container: {reference}", file=sys.stderr)
            status = 1
        elif container.exists():
            container.remove()
            print(reference)
    return status


def matches(container: Container, condition: str) -> bool:
    """One ``--filter``: ``label=K=V`` or ``name=REGEX`` (searched, as docker does)."""
    kind, _, value = condition.partition("=")
    if kind == "label":
        key, _, wanted = value.partition("=")
        return container.meta["labels"].get(key) == wanted
    if kind == "name":
        return re.search(value, container.name) is not None
    fail(f"fake docker: unsupported filter {condition}")


def ps(args: list[str]) -> int:
    found, _ = options(args, {"--filter", "-f", "--format"})
    names = found.get("--format") == ["{{.Names}}"]
    for container in Container.all():
        if all(matches(container, condition) for condition in found.get("--filter", [])):
            print(container.name if names else container.meta["id"][:12])
    return 0


COMMANDS = {"version": version, "image": image, "pull": pull, "run": run, "exec": exec_, "rm": rm, "ps": ps}


def main(argv: list[str]) -> int:
    log_call("docker", argv)
    if os.environ.get("FAKE_DOCKER_ENGINE") == "down":
        fail(NO_ENGINE, 125 if argv[:1] == ["run"] else 1)
    command = COMMANDS.get(argv[0]) if argv else None
    if command is None:
        fail(f"fake docker: unsupported command {json.dumps(argv)}")
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
