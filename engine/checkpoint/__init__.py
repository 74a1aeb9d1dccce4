"""Checkpoints: a model's weights (:mod:`.model`, what ``hyflow convert`` writes and every job
loads) and a run's step checkpoints (:mod:`.checkpointer`: weights, optimizer, RNG and job
state, written every ``trainer.save_every`` steps and resumed by ``trainer.resume``)."""
