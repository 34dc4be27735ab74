"""The file tools' arguments and contents: the model's strings and switches checked, binary files refused,
text encoded and split into lines the same way by every tool."""

from __future__ import annotations

from batchrun.tools import ToolError


def optional_string(args: dict, name: str, *, allow_empty: bool = False) -> str | None:
    """A string argument, or None when absent or null (models send null for unused options)."""
    value = args.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ToolError(f"'{name}' must be a string, not {type(value).__name__}")
    if not value and not allow_empty:
        raise ToolError(f"'{name}' must not be empty")
    return value


def required_string(args: dict, name: str, *, allow_empty: bool = False) -> str:
    value = optional_string(args, name, allow_empty=allow_empty)
    if value is None:
        raise ToolError(f"missing required argument '{name}'")
    return value


def switch(args: dict, name: str) -> bool:
    value = args.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ToolError(f"'{name}' must be true or false, not {value!r}")
    return value


def refuse_binary(data: bytes, path: str) -> None:
    """A NUL byte marks a binary file, the same test grep -I uses."""
    if b"\0" in data:
        raise ToolError(f"{path!r} is a binary file; the file tools handle text only")


def editable_text(data: bytes, path: str) -> str:
    """Strictly decoded text: an edit must not silently rewrite bytes that are not UTF-8."""
    refuse_binary(data, path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path!r} is not UTF-8 text, so it cannot be edited safely") from None


def encode_text(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError("the content contains characters that are not valid Unicode text") from None
