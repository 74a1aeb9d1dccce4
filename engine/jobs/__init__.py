"""The jobs hyflow runs, each a short entry point over the library.

* :mod:`.registry` -- ``job:`` name -> config schema and run function; loading a job's config;
* :mod:`.loop` -- the loop every job shares (``open_run`` / ``run_job``): resume, metrics,
  checkpoints, stop signals, the NaN/inf guard; :mod:`.step_end` its end of a step;
* :mod:`.rl` -- the RL job (``rl_step``: one step's numbered phases); :mod:`.one_step_off` its
  placement pools (one_step_off and pooled sync), :mod:`.fully_async` the generation loop of
  ``trainer.mode: async``; :mod:`.rl_config`, :mod:`.algorithm_config`,
  :mod:`.trainer_config` its config; :mod:`.rl_preflight` the checks before any rank starts;
  :mod:`.verl_keys` verl's command-line keys;
* :mod:`.dpo` -- DPO and KTO (:mod:`.preference_config`, :mod:`.preference_models`,
  :mod:`.preference_losses`, :mod:`.preference_validation`);
* :mod:`.lm` -- the language-model job (:mod:`.lm_config`), the training stack alone;
* :mod:`.run_config` -- a run directory's config, never continued silently with another.
"""
