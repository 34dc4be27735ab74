"""The tool registry: everything about each tool — its OpenAI function schema, its toolset, its
handler, its availability, whether it acts in the prompt's environment, its per-process tear-down.
A new tool is one module of handlers and one :data:`TOOLS` entry; nothing else names it.

The registry is fixed: its key set defines the ``tool_stats`` columns of every row, whatever is
installed on the machine, so every trajectory file has one Arrow schema. What is *available* on this
machine is a separate question answered by :func:`unavailable_tools`.
"""

from __future__ import annotations

import importlib
import sys
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchrun.tools.configuration import (
    extract_backend,
    image_provider,
    search_backend,
    unavailable_line,
    vision_endpoint,
)

if TYPE_CHECKING:
    from batchrun.tools import ToolContext

Handler = Callable[[dict, "ToolContext"], Awaitable[dict]]


def _browser_unavailable() -> str | None:
    """Asked of batchrun.tools.browser.availability only when someone asks: rows, statistics and the CLI
    read this table without loading a tool's implementation."""
    from batchrun.tools.browser.availability import unavailable_reason
    return unavailable_reason()


@dataclass(frozen=True)
class ToolSpec:
    """One tool. Per-process set-up belongs in the handler, on first use (the browser starts Chromium on
    its first call), so that a process that never calls the tool never pays for it; what such set-up
    leaves running is stopped by ``process_teardown`` when the worker ends."""

    name: str
    toolset: str
    description: str
    parameters: dict
    handler_path: str                       # "module:function", imported on first use
    unavailable_reason: Callable[[], str | None] = lambda: None
    # Acts in the prompt's environment (runs commands, reads or saves files there): a session offering
    # it starts one; a session offering none of these starts none.
    needs_environment: bool = False
    # Acts on what the model wrote (its commands, its file edits): never offered where no sandbox holds
    # the environment, unless the user chose an unisolated one.
    needs_isolation: bool = False
    # "module:function", a coroutine function of no arguments that the worker awaits once at its end,
    # if that module was loaded in the process; tools sharing a module name it once.
    process_teardown: str | None = None

    @property
    def schema(self) -> dict:
        """The OpenAI ``tools`` entry for this tool."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description,
                             "parameters": self.parameters}}


def _params(properties: dict[str, Any], required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required}


_STRING = {"type": "string"}
_INT = {"type": "integer"}
# Every browser tool drives the worker's one shared Chromium, started by the first call.
_BROWSER: dict[str, Any] = {"unavailable_reason": _browser_unavailable,
                            "process_teardown": "batchrun.tools.browser.launch:close_browser"}
_REF = {"type": "string", "description": "Element reference from the latest browser_snapshot, e.g. 'e12'."}

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("web_search", "web",
             "Search the web. Returns a list of results, each with title, url and snippet.",
             _params({"query": {**_STRING, "description": "What to search for."},
                      "max_results": {**_INT, "description": "How many results (default 5, at most 20)."}},
                     ["query"]),
             "batchrun.tools.search:web_search", unavailable_line(search_backend)),
    ToolSpec("web_extract", "web",
             "Fetch web pages and return the main text of each as markdown (navigation and other "
             "boilerplate removed; long pages are cut). A URL that fails gets its own error.",
             _params({"urls": {"type": "array", "items": _STRING,
                               "description": "http(s) URLs to fetch (at most 5)."}},
                     ["urls"]),
             "batchrun.tools.extract:web_extract", unavailable_line(extract_backend)),
    ToolSpec("terminal", "terminal",
             "Run a shell command in your own working directory and return its output and exit code. "
             "Each call starts in the working directory; chain commands with && when they depend on a cd.",
             _params({"command": {**_STRING, "description": "The shell command to run (bash)."},
                      "timeout": {**_INT, "description": "Seconds before the command is killed "
                                                         "(optional; capped by the run's limit)."}},
                     ["command"]),
             "batchrun.tools.terminal:terminal", needs_environment=True,
             needs_isolation=True),
    ToolSpec("read_file", "file",
             "Read a text file from your working directory, optionally a window of lines.",
             _params({"path": {**_STRING, "description": "Path relative to the working directory."},
                      "offset": {**_INT, "description": "First line to return, 1-based (default 1)."},
                      "limit": {**_INT, "description": "How many lines to return (default 500)."}},
                     ["path"]),
             "batchrun.tools.files:read_file", needs_environment=True,
             needs_isolation=True),
    ToolSpec("write_file", "file",
             "Write a text file in your working directory, creating directories as needed; "
             "replaces the file if it exists.",
             _params({"path": {**_STRING, "description": "Path relative to the working directory."},
                      "content": {**_STRING, "description": "The complete new file content."}},
                     ["path", "content"]),
             "batchrun.tools.files:write_file", needs_environment=True,
             needs_isolation=True),
    ToolSpec("patch", "file",
             "Edit a file: replace an exact string (old_string -> new_string), or apply a unified diff.",
             _params({"path": {**_STRING, "description": "File to edit (not needed for a diff that names "
                                                        "its files)."},
                      "old_string": {**_STRING, "description": "Exact text to replace; must occur once "
                                                              "unless replace_all is true."},
                      "new_string": {**_STRING, "description": "Replacement text."},
                      "replace_all": {"type": "boolean", "description": "Replace every occurrence."},
                      "diff": {**_STRING, "description": "A unified diff to apply instead of "
                                                        "old_string/new_string."}},
                     []),
             "batchrun.tools.files:patch", needs_environment=True,
             needs_isolation=True),
    ToolSpec("search_files", "file",
             "Search your working directory: a regular expression over file contents, or a glob "
             "over file names.",
             _params({"pattern": {**_STRING, "description": "Regex (contents) or glob (names)."},
                      "target": {"type": "string", "enum": ["content", "files"],
                                 "description": "'content' (default) or 'files'."},
                      "path": {**_STRING, "description": "Directory to search (default '.')."},
                      "max_results": {**_INT, "description": "At most this many matches (default 50)."}},
                     ["pattern"]),
             "batchrun.tools.files:search_files", needs_environment=True,
             needs_isolation=True),
    ToolSpec("browser_navigate", "browser", "Open a URL in the browser and return a snapshot of the page.",
             _params({"url": {**_STRING, "description": "http(s) URL."}}, ["url"]),
             "batchrun.tools.browser.actions:navigate", **_BROWSER),
    ToolSpec("browser_snapshot", "browser",
             "Return the current page as text with element references ([ref=eN]) for click and type.",
             _params({}, []), "batchrun.tools.browser.actions:snapshot", **_BROWSER),
    ToolSpec("browser_click", "browser", "Click the element with the given reference.",
             _params({"ref": _REF}, ["ref"]), "batchrun.tools.browser.actions:click", **_BROWSER),
    ToolSpec("browser_type", "browser",
             "Type text into the input with the given reference (replacing what it held).",
             _params({"ref": _REF, "text": {**_STRING, "description": "Text to type."}}, ["ref", "text"]),
             "batchrun.tools.browser.actions:type_text", **_BROWSER),
    ToolSpec("browser_scroll", "browser", "Scroll the page up or down.",
             _params({"direction": {"type": "string", "enum": ["up", "down"]}}, ["direction"]),
             "batchrun.tools.browser.actions:scroll", **_BROWSER),
    ToolSpec("browser_back", "browser", "Go back to the previous page.",
             _params({}, []), "batchrun.tools.browser.actions:back", **_BROWSER),
    ToolSpec("browser_press", "browser", "Press a keyboard key (e.g. Enter, Tab, ArrowDown).",
             _params({"key": {**_STRING, "description": "Key name."}}, ["key"]),
             "batchrun.tools.browser.actions:press", **_BROWSER),
    ToolSpec("browser_get_images", "browser", "List the images on the current page with their URLs and alt text.",
             _params({}, []), "batchrun.tools.browser.actions:get_images", **_BROWSER),
    # vision_analyze needs no configuration (it asks the run's own model and endpoint) but may name another.
    ToolSpec("vision_analyze", "vision",
             "Answer a question about an image given by http(s) URL or by the path of a PNG, JPEG, GIF "
             "or WebP file in your working directory.",
             _params({"image": {**_STRING, "description": "Image URL or file path."},
                      "question": {**_STRING, "description": "What to find out about the image."}},
                     ["image", "question"]),
             "batchrun.tools.vision:vision_analyze", unavailable_line(vision_endpoint),
             needs_environment=True),                                            # reads images from it
    ToolSpec("image_generate", "image_gen",
             "Generate an image from a text prompt; returns its URL, or the path of the image file "
             "saved in your working directory.",
             _params({"prompt": {**_STRING, "description": "Description of the image."}}, ["prompt"]),
             "batchrun.tools.image_gen:image_generate", unavailable_line(image_provider),
             needs_environment=True),                                            # saves the image there
)

REGISTRY: dict[str, ToolSpec] = {tool.name: tool for tool in TOOLS}
TOOL_NAMES: tuple[str, ...] = tuple(REGISTRY)
TOOL_TO_TOOLSET_MAP: dict[str, str] = {tool.name: tool.toolset for tool in TOOLS}

# A toolset named in a distribution -> the tools it enables. "search" is web_search on its own.
TOOLSETS: dict[str, tuple[str, ...]] = {}
for _tool in TOOLS:
    TOOLSETS.setdefault(_tool.toolset, ())
    TOOLSETS[_tool.toolset] += (_tool.name,)
TOOLSETS["search"] = ("web_search",)


def tools_for_toolsets(toolsets: list[str] | tuple[str, ...]) -> list[str]:
    """Registry order, de-duplicated: the tools a prompt with these toolsets may be offered."""
    wanted = {name for toolset in toolsets for name in TOOLSETS[toolset]}
    return [name for name in TOOL_NAMES if name in wanted]


def toolsets_offering(toolsets: list[str] | tuple[str, ...], offered_tools: list[str]) -> list[str]:
    """The toolsets (of those sampled, in their order) that gave the model at least one tool."""
    offered = set(offered_tools)
    return [toolset for toolset in toolsets if offered.intersection(TOOLSETS[toolset])]


def unavailable_tools() -> dict[str, str]:
    """Tool name -> the one line that makes it available, for every tool this machine cannot run."""
    reasons = {}
    for tool in TOOLS:
        reason = tool.unavailable_reason()
        if reason:
            reasons[tool.name] = reason
    return reasons


def unavailable_lines(unavailable: dict[str, str]) -> list[str]:
    """"tools — what enables them", one line per reason, for the start-up summary and --list_distributions."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    for name, reason in unavailable.items():
        by_reason[reason].append(name)
    return [f"{', '.join(names)} — {reason}" for reason, names in by_reason.items()]


def unavailable_note(toolsets: tuple[str, ...], unavailable: dict[str, str]) -> str | None:
    """What of these toolsets (one distribution entry) ``unavailable`` leaves out, for --list_distributions:
    None when nothing, "unavailable here" when all of it, else the toolsets and tools missing."""
    missing: list[str] = []
    for toolset in toolsets:
        gone = [name for name in TOOLSETS[toolset] if name in unavailable]
        missing += [toolset] if len(gone) == len(TOOLSETS[toolset]) else gone
    if not missing:
        return None
    if missing == list(toolsets):
        return "unavailable here"
    return f"{', '.join(missing)} unavailable here"


def needs_environment(tool_names: list[str] | tuple[str, ...]) -> bool:
    """Whether a session offering these tools needs an environment."""
    return any(REGISTRY[name].needs_environment for name in tool_names)


def toolsets_needing_isolation(toolsets: set[str] | frozenset[str]) -> set[str]:
    """Those of ``toolsets`` that hold a tool acting on what the model wrote (see ToolSpec.needs_isolation)."""
    return {toolset for toolset in toolsets if any(REGISTRY[name].needs_isolation for name in TOOLSETS[toolset])}


async def tear_down_process() -> None:
    """End what the tools started in this worker process (the browser's Chromium...). A tool module
    this process never loaded started nothing, and is not imported just to be told so. One hook
    failing must not keep the others from running: the worker is ending either way."""
    for path in dict.fromkeys(tool.process_teardown for tool in REGISTRY.values() if tool.process_teardown):
        module_name, _, function_name = path.partition(":")
        module = sys.modules.get(module_name)
        if module is None:
            continue
        try:
            await getattr(module, function_name)()
        except Exception:   # nothing useful to report at a worker's end; the next hook still runs
            pass


_handlers: dict[str, Handler] = {}


def get_handler(name: str) -> Handler:
    """The coroutine function implementing a tool (imported lazily: heavy tools cost nothing unused)."""
    handler = _handlers.get(name)
    if handler is None:
        module_name, _, function_name = REGISTRY[name].handler_path.partition(":")
        handler = getattr(importlib.import_module(module_name), function_name)
        _handlers[name] = handler
    return handler


async def dispatch(name: str, args: dict, ctx: ToolContext) -> dict:
    """Run one tool call. Unknown names are the session's job; ToolError propagates to it."""
    return await get_handler(name)(args, ctx)
