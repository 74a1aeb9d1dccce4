"""The RL job's parts: its models (:mod:`.models`), rollout batches (:mod:`.batch`), per
micro-batch losses and forward-only scoring (:mod:`.losses`) and the reward model
(:mod:`.reward_model`). The step itself reads top to bottom in :mod:`hyflow.jobs.rl`."""
