"""--backend=ray: agent sessions in Ray actors, on one machine or spread over a cluster.

The parent stays the only writer of data/<run_name>/: an actor returns each prompt's row already
encoded (a :class:`~batchrun.messages.Finished`, exactly what a worker process sends), and
:class:`~batchrun.ray.pool.RayWorkerPool` is a :class:`~batchrun.workers.WorkerPool` as the local one is,
so scheduling, rows, checkpoint, merge and resume are those of a local run.

* Actors: one per CPU the run may use (at most ``--num_workers``), spread over the nodes, each running
  its share of the sessions on its asyncio loop with the same code as a worker process
  (:func:`batchrun.worker_process.outcome`).
* Scheduling is per prompt, as locally: the parent counts each actor's free slots, hands one task to
  the least loaded actor and ``ray.wait``\\s on the outstanding results, so a slow prompt holds one slot.
  (``ray.util.multiprocessing.Pool`` would deal tasks round-robin and let them pile up behind a slow one.)
* Rate limits stay run-wide: a small :class:`~batchrun.ray.gate.GateKeeper` actor holds the limit on model
  requests at once (adaptive, see batchrun.concurrency: every request asks it for a slot and reports how it
  went), the 429 pause and the requests-per-minute pace; every actor's :class:`~batchrun.ray.gate.RayRateGate`
  learns of a pause at once (a long poll) and reserves paced slots from it. Pauses and paced slots are
  wall-clock times, so nodes' clocks should agree (NTP) to well under the pace.
* Without ``RAY_ADDRESS`` the runner starts a private Ray on this machine, on 127.0.0.1 only, and
  stops it at the end; a small watcher process ends that Ray's processes even after ``kill -9``.
  With ``RAY_ADDRESS`` it joins that cluster and leaves it running.
  A ``RAY_ADDRESS`` where nothing answers stops the run at once (Ray alone would retry for minutes).
* Each actor first checks that the run's TERMINAL_ENV, and every tool the run may offer, work on its
  node; the run stops with one message naming the node otherwise, before any model call.
* A lost actor (its node gone, its process killed) does not stop the run: its prompts in flight go to
  the actors that remain, once more each (a prompt whose actor is lost again gets a failure row, which
  resume retries: a prompt that kills its worker cannot take every actor down), and a replacement
  actor is started where the cluster has room. Only losing every actor, with none to replace it,
  stops the run.

The modules: ``cluster`` (which Ray: start or join), ``watcher`` (ends a private Ray after the runner),
``node_checks`` (what keeps a node from running the sessions), ``actor`` (the session actor), ``gate``
(the run-wide rate limits in an actor), ``node_loss`` (what becomes of a lost actor's prompts) and
``pool`` (RayWorkerPool, the parent's side).

Ray is imported in this package only, and only when a run asks for it: this file imports nothing, so
that importing a module of the package never needs the optional extra.
"""
