"""What becomes of the prompts of a lost Ray session actor (its node gone, its process killed).

Apart from the pool because it is the rule a reader looks for, away from the pool's bookkeeping of slots
and references: each prompt the lost actor was running goes once more to the actors that remain, and a
prompt lost for the second time gets a failure row that resume retries, so a prompt that kills its worker
cannot take every actor down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.config import RunConfig
from batchrun.messages import Finished, Task

LOST_ACTOR_ERROR_TYPE = "worker_died"      # as for a local worker process that died under its prompts


@dataclass(frozen=True)
class Attempt:
    """A prompt on its way to an actor, with the actors lost while it ran on them before."""

    task: Task
    losses: tuple[str, ...] = ()


@dataclass(frozen=True)
class Replacement:
    """An actor started in place of a lost one, usable once its probe answers."""

    actor: Any
    slots: int
    deadline: float       # time.monotonic() after which it is given up


def share_out(victims: list[Attempt], actor: str, config: RunConfig) -> tuple[list[Finished], list[Attempt]]:
    """The prompts the lost ``actor`` was running: the failure rows of those lost for the second time,
    and the others' next attempts, to go to the actors that remain."""
    failed = [_lost_twice(victim.task, (*victim.losses, actor), config) for victim in victims if victim.losses]
    again = [Attempt(victim.task, (actor,)) for victim in victims if not victim.losses]
    return failed, again


def _lost_twice(task: Task, losses: tuple[str, ...], config: RunConfig) -> Finished:
    """The failure row of a prompt whose actor was lost twice: perhaps the prompt kills its worker,
    and it must not take every actor down. It is retried on resume, like every failure."""
    from batchrun.worker_process import lost_task  # the model client's imports, only when needed

    error = ("the Ray session actors running this prompt were lost twice: "
             + "; ".join(f"actor {name}" for name in losses) + "; --resume runs it again")
    return lost_task(task, config, error, LOST_ACTOR_ERROR_TYPE)
