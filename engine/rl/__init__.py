"""The RL job's parts: its models and roles (:mod:`.models`; the roles' interfaces are
:mod:`hyflow.roles`), the data plane (:mod:`.dispatch`), rollout batches (:mod:`.batch`), per
micro-batch loss objects and forward-only scoring (:mod:`.step_losses`), the critic (:mod:`.critic`),
exact mode (:mod:`.exact_logprobs`), the reward model (:mod:`.reward_model`) and the update
(:mod:`.update`). The step itself reads top to bottom in :mod:`hyflow.jobs.rl`."""
