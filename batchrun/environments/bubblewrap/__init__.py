"""The bubblewrap backend (the default): a sandbox per prompt that no other prompt used.

``environment`` is the backend as the runner sees it; ``sandbox`` makes sandboxes and keeps spares;
``shell`` speaks to the shell inside one (``shell.sh``); ``program`` finds a working bwrap and builds its
command line; ``root`` is the read-only root every sandbox of a run sees.
"""

from batchrun.environments.bubblewrap.environment import BubblewrapEnvironment
from batchrun.environments.bubblewrap.program import Bwrap, bubblewrap_problem, bwrap_candidates, working_bwrap

__all__ = ["Bwrap", "BubblewrapEnvironment", "bubblewrap_problem", "bwrap_candidates", "working_bwrap"]
