"""Models in Hugging Face's formats, read tensor by tensor: an HF directory (safetensors, sharded
or not, or ``pytorch_model*.bin``) or a ``.gguf`` file.

* :mod:`.source`, :mod:`.safetensors_source`, :mod:`.torchbin_source`, :mod:`.gguf_source`,
  :mod:`.model_source`: streaming weight readers (headers first, then slices on demand) and the
  input checks;
* :mod:`.shard_reader`: exactly one rank's shard of a Megatron parameter from the HF tensors;
* :mod:`.hf_weights`: a job's starting weights straight from an HF model (``actor.checkpoint`` =
  an HF directory or ``.gguf`` file), each rank reading only its shards, nothing written to disk.

``hyflow convert hf2mcore`` (:mod:`hyflow.tools.convert`) writes the same shards into a hyflow
checkpoint.
"""
