"""The terminal tool: one shell command in the prompt's environment.

A non-zero exit code is an ordinary result the model reads and reacts to, so ``error`` stays None for
it; only a time-out (or an environment that could not run the command) fills ``error``, which makes
the statistics count the call as failed.
"""

from __future__ import annotations

import math

from batchrun.tools import ToolContext, ToolError
from batchrun.tools.arguments import shell_word


async def terminal(args: dict, ctx: ToolContext) -> dict:
    """Run ``command``; returns its combined output, exit code and error."""
    command = args.get("command")
    if not isinstance(command, str) or not command.strip():
        raise ToolError("'command' must be a non-empty string")
    shell_word("command", command)
    timeout = _timeout(args.get("timeout"), ctx.settings.command_timeout)
    result = await ctx.environment().run(command, timeout=timeout)
    if result.timed_out:     # a limit it ran into first is still named
        error = "; ".join([f"Command timed out after {timeout:g}s and was killed", *filter(None, [result.error])])
        return {"output": result.output, "exit_code": None, "error": error}
    return {"output": result.output, "exit_code": result.exit_code, "error": result.error}


def _timeout(value: object, limit: float) -> float:
    """The model's timeout, which may shorten the run's limit but never extend it."""
    if value is None:
        return limit
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ToolError(f"'timeout' must be a positive number of seconds, not {value!r}")
    return min(float(value), limit)
