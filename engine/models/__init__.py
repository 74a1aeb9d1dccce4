"""Models free of parallelism: what a model is and how Megatron-Core builds it.

* :mod:`.description` -- ``ModelDescription`` (the architecture, read from configs and checkpoints);
* :mod:`.builder` -- GPTModel from a description through a ModuleSpec; :mod:`.stage_split` the
  pipeline stages' layers;
* :mod:`.weights`, :mod:`.hf_mapping` -- full state dicts in and out, Hugging Face names;
  :mod:`.sources` -- HF and GGUF files read tensor by tensor;
* :mod:`.rope`, :mod:`.rotary`, :mod:`.positions`, :mod:`.norms`, :mod:`.embedding_grad` -- RoPE
  families and layer details;
* :mod:`.sdpa_attention`, :mod:`.ulysses_attention`, :mod:`.context_parallel` -- attention and
  context parallelism.
"""
