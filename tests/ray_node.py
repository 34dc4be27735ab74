"""`ray start ARGS...` for a test cluster of several Ray nodes on this one machine, on 127.0.0.1 only.

Ray keeps every address on loopback only with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and with that same
variable its `ray start` refuses to join a second node to a cluster ("Multi-node Ray clusters are not
supported"). Without the variable Ray rewrites 127.0.0.1 to the machine's external address (and the
join hangs here). So the variable stays 0 for Ray's processes, and only the `ray start` command itself
sees a copy of Ray's constants that allows clusters.

    python tests/ray_node.py --head --node-ip-address=127.0.0.1 --port=P --num-cpus=1 --temp-dir=T ...
    python tests/ray_node.py --address=127.0.0.1:P --node-ip-address=127.0.0.1 --num-cpus=1 ...
"""

from __future__ import annotations

import os
import sys
import types

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # before Ray is imported: it reads it then

import ray._private.ray_constants as ray_constants
from ray.scripts import scripts

allowing_clusters = types.ModuleType(ray_constants.__name__)
allowing_clusters.__dict__.update(ray_constants.__dict__)
allowing_clusters.ENABLE_RAY_CLUSTER = True
scripts.ray_constants = allowing_clusters

if __name__ == "__main__":
    sys.argv = ["ray", "start", *sys.argv[1:]]
    scripts.main()
