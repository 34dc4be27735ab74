"""What the user sees while a run goes on and when it ends: ``run_console.py`` (RunConsole: progress,
each prompt's line, warnings, the summary) over ``layout.py`` (lines fitted to the reader's width, and
nothing a terminal would take as a command); ``streams.py``: stdout and stderr, whose loss ends nothing."""

from batchrun.console.run_console import RunConsole, counted

__all__ = ["RunConsole", "counted"]
