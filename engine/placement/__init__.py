"""Placement: the roles of an RL run on their own rank pools and layouts.

* :mod:`hyflow.placement.config` — the ``placement:`` section and its resolution (pure);
* :mod:`hyflow.placement.groups` — process groups of a role on its pool, Megatron's state for it;
* :mod:`hyflow.placement.rows` — rows of a batch moving between pools (plan, then tensors);
* :mod:`hyflow.placement.weight_sync` — the actor's shards to another pool's layout (plan, then tensors);
* :mod:`hyflow.placement.remote_critic` — the critic on a pool of its own, answering the training pool;
* :mod:`hyflow.placement.checkpoint` — checkpointing models that live on some ranks only.
"""
