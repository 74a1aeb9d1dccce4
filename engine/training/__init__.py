"""Training on Megatron-Core: one optimizer step and what guards it.

* :mod:`.step` -- ``train_step`` (the pipeline schedule over micro-batches, the loss-normalisation
  contract), position ids;
* :mod:`.optimizer`, :mod:`.optim_config` -- DDP wrapping and Megatron's optimizer and scheduler;
* :mod:`.logprobs`, :mod:`.output_head` -- vocab-parallel log-probs and entropy, the fused output head;
* :mod:`.supervisor` -- the step supervisor: stop signals, the NaN/inf guard, divergence.
"""
