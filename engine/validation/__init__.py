"""Validation on held-out data: the RL job's generate-and-score loop (:mod:`hyflow.validation.rl`,
verl's ``val-core/<data_source>/<var>/mean@N`` metrics from :mod:`hyflow.validation.metrics`), the
preference jobs' held-out accuracy and margins (:mod:`hyflow.jobs.preference_validation`) and
``hyflow eval`` (:mod:`hyflow.validation.cli`)."""
