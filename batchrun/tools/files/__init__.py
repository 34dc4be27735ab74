"""The file tools: read, write, patch and search files in the prompt's environment.

File I/O goes through the environment's ``read_file``/``write_file`` and searching runs grep/find
through its shell, so the same handlers serve every backend (local directory, containers). The
environment enforces confinement; these handlers validate the model's arguments, refuse binary
files, and shape the results the model sees. One tool a file (read_write.py holds two), beside the
arguments they share (arguments.py) and the unified diffs patch applies (diff.py).
"""

from batchrun.tools.files.patch import patch
from batchrun.tools.files.read_write import read_file, write_file
from batchrun.tools.files.search import search_files

__all__ = ["patch", "read_file", "search_files", "write_file"]
