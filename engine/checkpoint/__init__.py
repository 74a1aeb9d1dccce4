"""Checkpoints: a model's weights (:mod:`.model`, what ``hyflow convert`` writes and every job
loads) and a run's step checkpoints (:mod:`.checkpointer`: weights, optimizer, RNG and job
state, written every ``trainer.save_every`` steps and resumed by ``trainer.resume``).

One concept per file: :mod:`.discovery` (finding, resuming from, pruning and setting aside step
checkpoints), :mod:`.manifest` (per-file checksums, written in per-rank parts), :mod:`.trust` (no
code from a checkpoint: pickles are checked before they are read), :mod:`.finite` (no NaN / inf
weights saved or loaded), :mod:`.run_lock` (one run per run directory), :mod:`.rng` (random
streams as plain tensors), :mod:`.optimizer_state` (Megatron optimizer-state formats and
repairs), :mod:`.megatron_io` (calling dist_checkpointing), :mod:`.architecture` (a config's
model from its checkpoint), :mod:`.agree` (rank 0's decisions as tensors), :mod:`.files` and
:mod:`.errors`."""
