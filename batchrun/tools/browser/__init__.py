"""The browser tools: a real Chromium driven by Playwright, one private tab per session.

- ``actions``: the tools the model calls (navigate, snapshot, click, type, scroll, back, press, get_images).
- ``tab``: one session's browser context and page, and the time each call on the page may take.
- ``caps``: what one result may hold, and the notes saying what was cut.
- ``launch``: this process's Chromium, launched on first use and closed at the worker's end (``close_browser``).
- ``isolation``: the bwrap command lines of Chromium's network namespace and sandbox.
- ``enter_namespace.py``: the program run as the namespace's first process (handing over the gate's socket).
- ``gate``: the SOCKS5 gate that every connection of a session's browser passes, enforcing the address policy.
- ``availability``: whether Playwright and a Chromium are here (``unavailable_reason``), asked by the parent process.

Nothing is imported here: the parent process asks ``availability`` alone, and loads no tool with it.
"""
