"""Adaptive concurrency: how many model requests the whole run keeps in flight at once.

An endpoint with a per-key concurrency limit answers 429 (or 503) to whatever goes beyond it. With more
sessions than that limit, a fixed worker count meets the limit on every round of requests, and a pause
shared by every session only brings them back together. So the run looks for the limit and stays just
under it, the way TCP's congestion window does (AIMD):

* every request is admitted against one run-wide limit on requests in flight: requests, not sessions,
  because a session busy in a tool asks nothing of the endpoint;
* the start, until something first pushes back: every answer raises the limit by one (it doubles per
  round of answers, like TCP's slow start), and while requests wait for a slot it also doubles once
  no request has gone out for START_DOUBLING seconds. A refusal comes back at once, an answer only
  after the model wrote it: against an endpoint that takes many seconds per answer, waiting for
  answers would keep most sessions idle for minutes, while time without a refusal already says the
  server took what it was sent (and against a quick one, answers keep requests going out, and
  answers raise the limit);
* after the start, each answer raises the limit by ``step / limit``, so by ``step`` per round of
  answers; the step doubles every round in which nothing pushed back. After a decrease the step
  starts small: the limit creeps up to where the server refused last and probes past it only after a
  few rounds, yet a raised endpoint limit is found within a few more;
* a 429 or 503 lowers the limit to BACKOFF times (and at least one below) the requests in flight when
  it comes back. Refusals come back at once, so those are the requests the server holds plus the
  refusals still on their way: a burst of refusals walks the limit down to just under what the server
  takes, about a slot per refusal, instead of multiplying it by BACKOFF once per refusal. The step
  starts again at STEP_AFTER_DECREASE;
* a round of answers slower on average than LATENCY_TOLERANCE times the usual lowers it as well: a
  server that queues requests instead of refusing them shows its limit in latency. Whole rounds, not
  single answers, because the first answers to come back are the quickest ones: measured against
  them, the usual answers of an endpoint whose answers vary in length would look like queueing.

Answers move the limit only while requests are waiting for a slot (the limit, not the sessions, holds
the run back) and only if they were sent under the limit as it is now.

The limit stays between 1 and the ceiling (--num_workers: there are never more requests than sessions);
with --adaptive_concurrency=False it stays at the ceiling. The controller is plain functions over
:class:`AimdState`, a ctypes structure, so that the same code runs over shared memory for the worker
processes (batchrun/concurrency/shared.py) and inside the Ray gate actor (batchrun/ray/gate.py).
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

INITIAL_LIMIT = 16          # requests at once before anything is known
# While requests wait, the start doubles the limit this often. Longer than a refusal takes to come back
# (one round trip, a new connection's handshakes included), so that a doubling past the server's limit
# is refused before the next one.
START_DOUBLING = 0.5
BACKOFF = 0.95              # a refusal leaves this share of the concurrency at which it came
# Slots per round right after a decrease: the slot given up comes back after three or four rounds.
# A whole slot would probe past the server's limit every round or two when that limit is small (at 8,
# one request in eight or more would be refused).
STEP_AFTER_DECREASE = 0.125
# A round of answers this many times slower than usual means the server is queueing requests. Less would
# take the runner's own load (a busy event loop reads answers late) and the spread of answer lengths for
# queueing.
LATENCY_TOLERANCE = 3.0
# The most an outage holds the prompts in flight (note_failure): an hour of it costs them none of their
# retries; a longer one, or a dataset whose every request the endpoint fails as if it were down, fails
# them as before the hold, not one wave of prompts an hour for ever.
LONGEST_HOLD = 3600.0
UNLIMITED = 1 << 20         # the ceiling of a gate built without one (tests calling the endpoint directly)
# Room for an error type ("http_503", "bad_response", "rate_limited"), and the NUL ctypes keeps after it.
_CAUSE_BYTES = 16


class Outcome(enum.Enum):
    ANSWERED = "answered"        # a reply came: its latency counts
    OVERLOADED = "overloaded"    # 429 or 503: the server has more than it can take
    OTHER = "other"              # any other failure: says nothing about the server's load
    UNSENT = "unsent"            # the slot was given back before a request went out


class AimdState(ctypes.Structure):
    """The whole controller state, plain numbers so that it can live in shared memory."""

    _fields_ = [("limit", ctypes.c_double), ("ceiling", ctypes.c_double), ("adaptive", ctypes.c_bool),
                ("in_flight", ctypes.c_long), ("waiting", ctypes.c_long),   # requests waiting for a slot
                ("starting", ctypes.c_bool),            # nothing has pushed back yet
                ("next_doubling", ctypes.c_double),     # CLOCK_MONOTONIC when the start may double (0: not set)
                ("step", ctypes.c_double),
                ("epoch", ctypes.c_long),               # bumped by every decrease
                ("round_size", ctypes.c_long),          # judged answers that make this round
                ("round_limit", ctypes.c_double),       # the limit when it began
                ("round_answers", ctypes.c_long), ("round_latency", ctypes.c_double),   # so far, seconds summed
                ("usual_latency", ctypes.c_double),     # the lowest mean of a round, raised by latency decreases
                ("lowest", ctypes.c_double), ("highest", ctypes.c_double),
                ("requests", ctypes.c_long), ("overloaded", ctypes.c_long),
                ("retrying", ctypes.c_long),            # requests waiting to go again after a failure
                ("retried", ctypes.c_long),             # requests that went again, or will
                ("retry_cause", ctypes.c_char * _CAUSE_BYTES),   # the last retry's error type
                ("replies", ctypes.c_long),             # requests the endpoint answered (note_reply)
                ("down_since", ctypes.c_double)]        # wall clock when it was found down (0: it is up)


@dataclass(frozen=True)
class Ticket:
    """One admitted request, as the controller needs to judge its outcome."""

    epoch: int          # sent under the limit as it was after this many decreases


@dataclass(frozen=True)
class ConcurrencyFigures:
    """What the live display and statistics.json show."""

    adaptive: bool
    ceiling: int
    limit: int
    lowest: int
    highest: int
    requests: int
    rate_limited: int
    retrying: int
    retried: int
    retry_cause: str            # the last retry's error type, as a failure row would name it ("" before any)
    down_since: float = 0.0     # when the endpoint was found down, by the clock of where the figures were
                                # taken: which outage it is (0: it is up)
    down_for: float = 0.0       # seconds it has been down, where and when the figures were taken
    pause_left: float = 0.0     # seconds of the run's pause after a 429 left, where the gate says (Gate.pause_left)

    def as_dict(self) -> dict:
        """statistics.json's ``this_run.concurrency`` (docs/report.md)."""
        return {"adaptive": self.adaptive, "ceiling": self.ceiling, "final": self.limit, "min": self.lowest,
                "max": self.highest, "requests": self.requests, "rate_limited_requests": self.rate_limited,
                "retried_requests": self.retried}


# -- the controller ---------------------------------------------------------------------------------


def reset(state: AimdState, ceiling: int, adaptive: bool) -> AimdState:
    ceiling = max(1, ceiling)
    start = float(min(ceiling, INITIAL_LIMIT) if adaptive else ceiling)
    state.limit = state.lowest = state.highest = start
    state.ceiling, state.adaptive, state.starting = float(ceiling), adaptive, adaptive
    state.step = STEP_AFTER_DECREASE
    state.in_flight = state.waiting = state.epoch = state.requests = state.overloaded = 0
    state.retrying = state.retried = state.replies = 0
    state.retry_cause = b""
    state.down_since = 0.0
    state.next_doubling = state.usual_latency = 0.0
    _begin_round(state)
    return state


def new_state(ceiling: int, adaptive: bool) -> AimdState:
    return reset(AimdState(), ceiling, adaptive)


def slots(state: AimdState) -> int:
    """Requests the limit lets be in flight at once."""
    return int(state.limit)


def has_room(state: AimdState) -> bool:
    return state.in_flight < slots(state)


def admit(state: AimdState) -> Ticket:
    """Count one request in flight (the caller has checked there is room)."""
    state.in_flight += 1
    return Ticket(epoch=state.epoch)


def finish(state: AimdState, ticket: Ticket, outcome: Outcome, latency: float = 0.0) -> None:
    """A request is over: count it, and let what came of it move the limit."""
    in_flight = state.in_flight      # this request still included
    state.in_flight -= 1
    if outcome is Outcome.UNSENT:
        return
    if outcome is Outcome.ANSWERED:
        note_reply(state)
    state.requests += 1
    if outcome is Outcome.OVERLOADED:
        state.overloaded += 1
        if state.adaptive:
            _refused(state, in_flight)
    elif outcome is Outcome.ANSWERED and state.adaptive:
        _answered(state, ticket, latency)


def _refused(state: AimdState, refused_at: int) -> None:
    # At least a whole slot lower: under a small server limit BACKOFF alone would leave as many slots.
    target = min(BACKOFF * refused_at, refused_at - 1.0)
    if target < state.limit:
        _lower(state, target)


def _answered(state: AimdState, ticket: Ticket, latency: float) -> None:
    # Sent under the limit as it is now, while the limit keeps requests waiting: else the answer says
    # nothing about this limit.
    if ticket.epoch != state.epoch or state.waiting == 0:
        return
    state.round_answers += 1
    state.round_latency += latency
    if state.round_answers < state.round_size:
        _raise(state)
    elif _round_slower_than_usual(state, state.round_latency / state.round_answers):
        # What the round's answers raised is taken back: they were the slow ones.
        _lower(state, BACKOFF * min(state.limit, state.round_limit))
        # A model that is simply slower now (longer answers) should cost a few decreases, not the whole
        # limit: each one asks the latency to rise further before the next.
        state.usual_latency /= BACKOFF
    else:
        _raise(state)
        if not state.starting:
            state.step = min(2 * state.step, state.limit)      # at most doubling the limit per round
        _begin_round(state)


def _round_slower_than_usual(state: AimdState, mean: float) -> bool:
    if state.usual_latency == 0.0 or mean < state.usual_latency:
        state.usual_latency = mean
        return False
    return mean > LATENCY_TOLERANCE * state.usual_latency


def _begin_round(state: AimdState) -> None:
    """The next ``slots`` judged answers make a round: the requests in flight under this limit."""
    state.round_size, state.round_limit, state.round_answers, state.round_latency = slots(state), state.limit, 0, 0.0


def _lower(state: AimdState, target: float) -> None:
    state.limit = max(1.0, target)
    state.lowest = min(state.lowest, state.limit)
    state.step, state.starting = STEP_AFTER_DECREASE, False
    state.epoch += 1
    _begin_round(state)


def _raise(state: AimdState) -> None:
    state.limit = min(state.ceiling, state.limit + (1.0 if state.starting else state.step / state.limit))
    state.highest = max(state.highest, state.limit)


def note_sent(state: AimdState, now: float) -> None:
    """A request goes out at ``now``: the start doubles no sooner than START_DOUBLING after it (slots
    whose requests have not gone yet tell nothing of the server)."""
    if state.starting:
        state.next_doubling = max(state.next_doubling, now + START_DOUBLING)


def grow_with_time(state: AimdState, now: float) -> float | None:
    """The start's growth without answers: while requests wait and nothing has pushed back, the limit
    doubles once no request has gone out for START_DOUBLING seconds (``now``: CLOCK_MONOTONIC, which
    every process shares). Callers ask while requests wait for a slot; the answer is how many seconds
    until they should ask again, None once time will not raise the limit any more."""
    if not state.starting or state.limit >= state.ceiling:
        return None
    if state.waiting == 0:
        return START_DOUBLING
    if state.next_doubling == 0.0:      # no request said it went out: those admitted so far go now
        state.next_doubling = now + START_DOUBLING
    if (due := state.next_doubling - now) > 0:
        return due
    state.limit = min(state.ceiling, 2 * state.limit)
    state.highest = max(state.highest, state.limit)
    state.next_doubling = now + START_DOUBLING
    # A round is the answers to what this limit lets out: one begun under the old limit would be made
    # of the quickest answers among more requests than it counts, too quick for the usual latency.
    _begin_round(state)
    return START_DOUBLING if state.limit < state.ceiling else None


def hold_growth(state: AimdState, now: float) -> None:
    """A worker's loop ran late at ``now``: refusals of what it sent last may have come back unread,
    so the start doubles no sooner than START_DOUBLING from now."""
    if state.starting and state.next_doubling:
        state.next_doubling = max(state.next_doubling, now + START_DOUBLING)


def figures(state: AimdState, now: float = 0.0) -> ConcurrencyFigures:
    """The figures; ``now`` (wall clock) gives ``down_for``."""
    down_for = max(0.0, now - state.down_since) if state.down_since and now else 0.0
    return ConcurrencyFigures(adaptive=state.adaptive, ceiling=int(state.ceiling), limit=slots(state),
                              lowest=int(state.lowest), highest=int(state.highest), requests=state.requests,
                              rate_limited=state.overloaded, retrying=state.retrying, retried=state.retried,
                              retry_cause=state.retry_cause.decode("ascii", "replace"),
                              down_since=state.down_since, down_for=down_for)


def note_retrying(state: AimdState, change: int, cause: str = "") -> None:
    """``change`` more requests wait to go again after a failure of type ``cause`` (fewer: they went,
    or gave up). They do not move the limit: what the live display shows while nothing finishes."""
    state.retrying += change
    state.retried += max(0, change)
    if cause:
        state.retry_cause = cause.encode("ascii", "replace")[:_CAUSE_BYTES - 1]


def note_reply(state: AimdState) -> None:
    """The endpoint answered a request: it is up. Only an answer says so: a gateway in front of a server
    that is down may well answer 400 or 429 itself."""
    state.replies += 1
    state.down_since = 0.0


def note_failure(state: AimdState, seen: int, now: float) -> tuple[int, bool]:
    """A call's request failed as only an endpoint that is down fails it (batchrun.endpoint.errors.
    says_endpoint_down) at ``now`` (wall clock), its slot still held. ``seen``: what this returned at the
    call's last such failure (-1 at its first).

    The endpoint is found down by such a failure with no other request in flight: a server that refuses one
    more request while it serves others is busy, not down. It stays down until it answers a request. Before
    the run's first answer it is not down but not there, or set up wrong: nothing to wait for.

    Returns what to pass as ``seen`` next time (the answers so far), and whether the failure is held: it
    costs the call none of its retries (batchrun.endpoint.call). It is held while the endpoint is down,
    for LONGEST_HOLD at most, unless the endpoint answered another request since the call's last such
    failure: then the failure may be the call's own doing (a gateway's 502 for a conversation that crashes
    the server behind it), and counts."""
    if not state.replies:
        return 0, False
    if not state.down_since and state.in_flight <= 1:
        state.down_since = now
    held = bool(state.down_since) and now - state.down_since < LONGEST_HOLD and seen in (-1, state.replies)
    return int(state.replies), held
