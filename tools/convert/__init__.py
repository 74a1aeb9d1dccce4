"""HF <-> Megatron-Core checkpoint converters (``hyflow convert``).

* :mod:`.hf2mcore`: HF directory (safetensors, sharded or not, or ``pytorch_model*.bin``)
  or ``.gguf`` file -> hyflow model checkpoint (Megatron dist checkpoint + ``model.json``,
  see :mod:`hyflow.checkpoint.model`), written by ``tp * pp`` ranks that each read only
  the slices they hold (:mod:`hyflow.models.sources.shard_reader`);
* :mod:`.mcore2hf`: hyflow model checkpoint (any layout) -> HF directory;
* the streaming weight readers live in the library (:mod:`hyflow.models.sources`: training jobs
  read HF models directly with them);
* :mod:`.preflight`: every input check, done before any heavy work;
* :mod:`.launch`: the local rank launcher; :mod:`.memory`: the peak-memory report;
* :mod:`.verify`: per-rank logits / greedy decoding of a checkpoint (parity checks);
* tiny random HF models of each family (tests, experiments): :mod:`hyflow.testing.tiny_models`;
* :mod:`.cli`: the ``hyflow convert`` subcommands.

Nothing here imports torch at package import time.
"""
