"""Adaptive concurrency: how many model requests the whole run keeps in flight at once.

- ``aimd.py``: the controller (AIMD over requests in flight: why and how, at its top), plain functions over
  one ctypes structure, so the same code runs over shared memory and inside the Ray gate actor;
- ``admission.py``: one request's slot, taken before it goes and given back with what came of it;
- ``shared.py``: the limit of the worker processes, in shared memory, and each process's line of waiters.
"""

from batchrun.concurrency.admission import Limit, Request, request_slot
from batchrun.concurrency.aimd import (
    BACKOFF,
    INITIAL_LIMIT,
    START_DOUBLING,
    UNLIMITED,
    AimdState,
    ConcurrencyFigures,
    Outcome,
    Ticket,
    admit,
    figures,
    finish,
    grow_with_time,
    has_room,
    hold_growth,
    new_state,
    note_failure,
    note_reply,
    note_retrying,
    note_sent,
    slots,
)
from batchrun.concurrency.shared import SharedLimit

__all__ = ["BACKOFF", "INITIAL_LIMIT", "START_DOUBLING", "UNLIMITED", "AimdState", "ConcurrencyFigures", "Limit",
           "Outcome", "Request", "SharedLimit", "Ticket", "admit", "figures", "finish", "grow_with_time",
           "has_room", "hold_growth", "new_state", "note_failure", "note_reply", "note_retrying", "note_sent",
           "request_slot", "slots"]
