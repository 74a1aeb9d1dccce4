"""Placement: the roles of an RL run on their own rank pools and layouts.

* :mod:`hyflow.placement.config` — the ``placement:`` section and its resolution (pure);
* :mod:`hyflow.placement.groups` — process groups of a role on its pool, Megatron's state for it;
* :mod:`hyflow.placement.rows` — rows of a batch moving between pools (plan, then tensors);
* :mod:`hyflow.placement.weight_sync` — the actor's shards to another pool's layout (plan, then tensors);
* :mod:`hyflow.placement.remote_critic` — the critic on a pool of its own, answering the training pool;
* :mod:`hyflow.placement.sync_planner` — who sends which slice of the actor to whom, bucketed;
* :mod:`hyflow.placement.pool_models` — the roles' pooled implementations (weight sender, remote rollouts);
* :mod:`hyflow.placement.inflight` — the training pool's control message and the generation pool's
  checkpointed batch in flight.
"""
