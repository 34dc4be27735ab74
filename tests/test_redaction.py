"""The redactor: the user's secrets never survive into anything written, whole or cut by a cap."""

from __future__ import annotations

import pytest

from batchrun.security import REDACTED, Redactor

SECRET = "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef"
CAP_NOTE = "\n[output truncated: 9000 more characters not shown]"


def pieces_of(secret: str, shortest: int) -> list[str]:
    """Every piece of ``secret`` at least ``shortest`` characters long that a cap could leave."""
    return [secret[start:end] for start in range(len(secret)) for end in range(start + shortest, len(secret) + 1)]


def test_a_whole_secret_is_replaced_wherever_it_appears():
    redact = Redactor([SECRET])
    assert redact(f"key={SECRET}; again {SECRET}.") == f"key={REDACTED}; again {REDACTED}."


def test_text_without_a_secret_is_left_as_it_is():
    text = "an ordinary line of output, with numbers 0123 4567 89ab and a key= that is empty"
    assert Redactor([SECRET])(text) == text


@pytest.mark.parametrize("cut", range(8, len(SECRET)))
def test_a_secret_cut_by_an_output_cap_leaves_no_usable_prefix(cut):
    redacted = Redactor([SECRET])("the key is " + SECRET[:cut] + CAP_NOTE)
    assert not any(piece in redacted for piece in pieces_of(SECRET[:cut], 8)), redacted
    assert redacted.startswith("the key is ") and redacted.endswith(CAP_NOTE)


@pytest.mark.parametrize("cut", range(1, len(SECRET) - 7))
def test_a_secret_whose_start_a_cap_cut_off_leaves_no_usable_suffix(cut):
    redacted = Redactor([SECRET])("…" + SECRET[cut:] + " was in the log")
    assert SECRET[-8:] not in redacted and redacted.endswith(" was in the log")


def test_pieces_shorter_than_a_secret_can_be_are_kept():
    """Seven characters are kept: that many of a key are its public prefix ("sk-or-v"), and an
    ordinary word matching them is no reason to mangle text."""
    assert Redactor([SECRET])("sk-or-v and 0123456") == "sk-or-v and 0123456"


def test_several_secrets_and_overlapping_pieces_are_all_replaced():
    other = "ghp_abcdefghijklmnopqrstuvwxyz0123"
    redacted = Redactor([SECRET, other])(SECRET[:20] + other[10:] + " " + other + SECRET[-12:])
    assert not any(piece in redacted for secret in (SECRET, other) for piece in pieces_of(secret, 8))
