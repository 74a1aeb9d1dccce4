"""One vLLM engine in this process: a generation replica's ranks run it in lockstep (SPMD).

:class:`VLLMEngine` has the call shape of hyflow's :class:`~hyflow.rollout.engine.GenerationEngine`
(``generate(requests, sampling, request_offset) -> RolloutResult``), so the data plane
(:func:`hyflow.rollout.dp.generate_data_parallel`) splits a DP shard over micro-DP replicas and
gathers the samples back unchanged, and the same request semantics hold:

* requests expand into samples by :func:`hyflow.rollout.engine.prepare_requests` (prompt checks,
  truncation, stop ids, token budgets); every sample is its own vLLM request with ``n=1`` and the
  seed of hyflow's stream ``(seed, global prompt index, sample index)``, so a sample does not
  depend on the batch, the replica or the DP split, and the same seed gives the same tokens;
* log-probs are what the trainer recomputes: ``log_softmax(logits / T)`` of the sampled token over
  the whole vocabulary, before top-k / top-p (``T = 1`` for greedy). vLLM reports either the raw
  distribution (``logprobs_mode="raw_logprobs"``, before the temperature) or the processed one
  (after the temperature *and* the top-k / top-p truncation). So the temperature goes into the
  model instead: the logits processor scales the logits by ``1 / T`` (its ``scale``) and vLLM
  samples at temperature 1 from them (the same distribution, the same truncation sets), and its
  raw log-probs are then exactly the trainer's;
* the vocabulary vLLM sees is ``vocab_size`` (the ids the tokenizer can decode): no padded id is
  ever sampled and the log-prob's normaliser is the trainer's.

Design (vLLM 0.32, read from its source): in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
started through vLLM's *external launcher* executor, which reuses the running ``torch.distributed``
world instead of spawning workers; the generation TP ranks of one replica form one vLLM instance
(:mod:`hyflow.vllm_backend.groups` builds vLLM's groups from the hybrid engine's). The CPU build has
no sleep mode and no worker processes to pin threads, which the external launcher does not need;
pipeline stages (``PP_g > 1``) would need vLLM's PP-output broadcast, which its V2 runner lacks for
the external launcher, so the backend refuses ``rollout.layout.pp > 1`` at config time.

Weights: vLLM starts with a config.json only (``load_format="dummy"``), then every
:meth:`load_weights` writes the generation shards straight into vLLM's live weights
(:mod:`hyflow.vllm_backend.inplace`: planned once, in place; on CPU the GEMM weights either
repacked by vLLM's own post-load processing or, with ``rollout.vllm.cpu_gemm: plain``, kept as
loaded and copied into, :mod:`hyflow.vllm_backend.cpu_gemm`), or, where that plan does not apply
(online quantization such as fp8), goes through vLLM's own in-place reload (``reload_weights`` with the
checkpoint-format names of :mod:`hyflow.vllm_backend.weights`, its loaders fusing q/k/v and
gate/up). No file, no HF round trip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import random
import shutil
import tempfile
import time
import weakref
from typing import Callable, Iterable, Optional, Sequence as Seq

import torch
import torch.distributed as dist

from hyflow.models.description import ModelDescription
from hyflow.models.hf_mapping import hf_config_from_description
from hyflow.rollout.config import GenerationConfig, SamplingConfig
from hyflow.rollout.engine import prepare_requests
from hyflow.rollout.request import RolloutResult, RolloutStats, SampleOutput
from hyflow.vllm_backend.config import VLLMConfig
from hyflow.vllm_backend.cpu_gemm import is_plain, set_cpu_gemm
from hyflow.vllm_backend.groups import init_vllm_groups, local_rank
from hyflow.vllm_backend.inplace import InPlaceLoader, plan_in_place
from hyflow.vllm_backend.stream import VLLMStream, fill_finish, sampling_params
from hyflow.vllm_backend.weights import GenerationShards

LOG = logging.getLogger("hyflow.vllm")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: vLLM's KV-cache block on CPU (tokens; its default for most models there).
_CPU_BLOCK = 128
#: vLLM warnings that say nothing about this use of it, by the logger that emits them: no tokenizer
#: (hyflow tokenizes), rotary embeddings without weights to reload, its CPU worker refusing
#: thread-count changes (restored by :func:`_process_state_kept`).
_QUIET = {
    "vllm.renderers.base": ("Chat template warmup failed", "Using None for EOS token id"),
    "vllm.v1.worker.cpu_worker": ("doesn't allow to use `torch.set_num_threads`",),
    "vllm.model_executor.model_loader.reload.layerwise": ("Failed to load weights",),
}


class _QuietFilter(logging.Filter):
    def __init__(self, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in str(record.msg) for m in self.messages)


def _quiet_vllm_logs() -> None:
    """Drop the warnings of :data:`_QUIET` (vLLM's INFO chatter is off: VLLM_LOGGING_LEVEL=WARNING
    unless set)."""
    for name, messages in _QUIET.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietFilter) for f in logger.filters):
            logger.addFilter(_QuietFilter(messages))


def _own_shm_segment() -> Optional[str]:
    """The /dev/shm file of this rank's segment of vLLM's CPU TP communicator (a TP group of two
    ranks or more; None otherwise). vLLM never unlinks it, and each start has its own name
    (:func:`hyflow.vllm_backend.groups.init_vllm_groups`), so teardown removes it."""
    from vllm.distributed import parallel_state as ps  # optional dependency (loaded by then)

    tp = ps.get_tp_group()
    name = getattr(getattr(tp.device_communicator, "dist_module", None), "group_name", None)
    return None if name is None else os.path.join("/dev/shm", f"{name}_{tp.rank_in_group}")


def _teardown(client, folder: str, shm: Optional[str] = None) -> None:
    """vLLM's in-process engine teardown minus its last act, ``cleanup_dist_env_and_memory``, which
    destroys ``torch.distributed``'s default group (the training's). vLLM's groups go only while
    that world is still up (the job may have shut it down first); this rank's shared-memory
    segment ``shm`` goes too (mapped memory stays valid until unmapped)."""
    from vllm.distributed import parallel_state as ps  # optional dependency (loaded by then)

    core = client.engine_core
    if core.model_executor:
        core.model_executor.shutdown()
    if core.scheduler:
        core.scheduler.shutdown()
    gc.unfreeze()
    if dist.is_initialized():
        ps.destroy_model_parallel()
        if ps._WORLD is not None:
            ps._WORLD.destroy()
    ps._WORLD = None
    shutil.rmtree(folder, ignore_errors=True)
    if shm is not None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(shm)


def _kv_bytes(desc: ModelDescription, tp: int, tokens: int, itemsize: int) -> int:
    """KV-cache bytes for ``tokens`` tokens on one rank of a TP-``tp`` replica (keys and values)."""
    return 2 * desc.num_layers * (desc.num_query_groups // tp) * desc.head_dim * itemsize * tokens


@contextlib.contextmanager
def _process_state_kept(device: torch.device):
    """vLLM's start-up changes process-wide state the training side owns: it reseeds the global
    random generators, lowers the torch thread count and, on CPU, replaces ``torch.set_num_threads``
    with a no-op. Put all of it back afterwards (the CUDA generator of this rank's device only:
    touching the others would open a context on every visible GPU)."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    cpu_rng, py_rng = torch.random.get_rng_state(), random.getstate()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.random.set_rng_state(cpu_rng)
        random.setstate(py_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def _mark_presharded(model: torch.nn.Module) -> None:
    """Tell the TP-sharded linear layers' loaders that the tensors they get are this rank's shards
    already (the generation layout's, :mod:`hyflow.vllm_backend.weights`), so they copy instead of
    cutting their slice out of a whole tensor. vLLM re-creates the parameters of a layer it reloads
    from metadata recorded at start-up (``model_loader.reload``), so the marks go there: the
    ``is_sharded_weight`` flag its classic loaders honour, and rank 0 for the parameter classes
    whose loaders slice at ``tp_rank * shard`` (a shard at offset 0 of itself)."""
    # optional dependency (loaded by then)
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for layer in model.modules():
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) or layer.tp_size == 1:
            continue
        params, _ = get_layerwise_info(layer).restore_metadata
        live_bias = getattr(layer, "bias", None)  # built outside the metadata: it stays the live one
        for param in list(params.values()) + ([live_bias] if live_bias is not None else []):
            param.is_sharded_weight = True
            if "tp_rank" in vars(param):
                param.tp_rank = 0


_EXECUTOR = None


def _executor_class():
    """vLLM's external-launcher executor, agreeing on the KV-cache size inside the instance (its TP
    group) instead of over vLLM's whole world: with placement pools only the generation pool starts
    vLLM, and a world-wide all-reduce there would wait for the training pool forever. The ranks of
    one instance must agree (same blocks, same schedule); separate instances need not."""
    global _EXECUTOR
    if _EXECUTOR is None:
        # optional dependency: vLLM is imported only when its backend starts
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor

        class InTrainingRanksExecutor(ExecutorWithExternalLauncher):
            def determine_available_memory(self) -> list[int]:
                memory = UniProcExecutor.determine_available_memory(self)
                agreed = torch.tensor(memory, dtype=torch.int64)
                dist.all_reduce(agreed, group=get_tp_group().cpu_group, op=dist.ReduceOp.MIN)
                return agreed.tolist()

        _EXECUTOR = InTrainingRanksExecutor
    return _EXECUTOR


def _refresh_tied_head(model: torch.nn.Module) -> None:
    """Re-run the post-load processing of a tied output layer. vLLM's ``lm_head`` then shares the
    embedding's parameter, but the checkpoint names it nowhere, so a reload never processes it and
    the CPU build's GEMM weights it packed from the old values would stay."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and not is_plain(head):
        method.process_weights_after_loading(head)


class VLLMEngine:
    """vLLM on one generation replica (every rank of the replica builds and calls it alike).

    Args:
        desc: the actor's architecture.
        config: the rollout's engine and default sampling settings (hyflow's; vLLM honours the
            sampling, length and concurrency fields).
        options: ``rollout.vllm``.
        vocab_size: ids that may be sampled (the tokenizer's; the vocabulary vLLM's config declares).
        eos_token_ids: default end-of-sequence ids.
        tp_groups: the generation TP groups of the whole world (ranks), one vLLM instance each.
        dtype: the actor's dtype (fp32, bf16, fp16).
        seed: vLLM's own seed (``trainer.seed``; samples draw from their per-request seeds).
        device: the rank's device (``ParallelGroups.device``).
        seq_budget: prompt + response tokens a sequence of the run takes (the rollout's limits), what
            the CPU KV cache is sized for (a sequence may still use the whole context).
    """

    def __init__(self, desc: ModelDescription, config: GenerationConfig, options: VLLMConfig, *,
                 vocab_size: int, eos_token_ids: Seq[int], tp_groups: list[list[int]], dtype: str = "fp32",
                 seed: int = 0, device: Optional[torch.device] = None,
                 seq_budget: Optional[int] = None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM  # optional dependency, imported when the backend starts (after the env above)

        self.desc, self.config, self.options = desc, config, options
        self.vocab_size, self.eos_token_ids = vocab_size, [int(t) for t in eos_token_ids]
        tp = len(next(g for g in tp_groups if dist.get_rank() in g))
        self.tp = tp
        limit = config.max_seq_len or desc.context_length  # as hyflow's engine: the model's context
        self.max_seq_len = limit
        self.max_prompt_length = min(config.max_prompt_length or limit - 1, limit - 1)
        device = torch.device(device or "cpu")
        cuda = self.cuda = device.type == "cuda"
        # The external launcher reads the rank and the device index from the environment.
        os.environ["RANK"] = str(dist.get_rank())
        rank_on_node = local_rank(device)
        os.environ["LOCAL_RANK"] = str(rank_on_node)
        self._dir = tempfile.mkdtemp(prefix="hyflow-vllm-")
        hf = hf_config_from_description(dataclasses.replace(desc, vocab_size=vocab_size), dtype=_DTYPES[dtype])
        with open(os.path.join(self._dir, "config.json"), "w") as f:
            json.dump(hf, f)
        max_seqs = options.max_num_seqs or config.max_concurrent
        kv_bytes = options.kv_cache_memory_bytes
        if kv_bytes is None and not cuda:  # CPU: sized for the configured concurrency, not a memory share
            itemsize = torch.finfo(getattr(torch, _DTYPES[dtype])).bits // 8
            # vLLM wants room for one whole context, plus its null block; a sequence takes whole blocks (of
            # up to 128 tokens on CPU), so max_seqs sequences run at once only with max_seqs blocks' worth each
            blocks = -(-min(seq_budget or limit, limit) // _CPU_BLOCK)
            tokens = max(max_seqs * blocks * _CPU_BLOCK, limit) + 2 * _CPU_BLOCK
            kv_bytes = _kv_bytes(desc, tp, tokens, itemsize)
        self.sleep_level = options.sleep_level if cuda else 0  # vLLM's CPU build has no sleep mode
        kwargs = dict(
            model=self._dir, skip_tokenizer_init=True, load_format="dummy", dtype=_DTYPES[dtype], seed=seed,
            distributed_executor_backend=_executor_class(), tensor_parallel_size=tp,
            max_model_len=limit, max_num_seqs=max_seqs, enable_prefix_caching=options.enable_prefix_caching,
            enforce_eager=options.enforce_eager if options.enforce_eager is not None else not cuda,
            logprobs_mode="raw_logprobs", gpu_memory_utilization=options.gpu_memory_utilization,
            enable_sleep_mode=self.sleep_level > 0, disable_log_stats=True)
        for key in ("kv_cache_memory_bytes", "max_num_batched_tokens", "quantization"):
            value = kv_bytes if key == "kv_cache_memory_bytes" else getattr(options, key)
            if value is not None:
                kwargs[key] = value
        _quiet_vllm_logs()
        with _process_state_kept(device):
            init_vllm_groups(tp_groups, rank_on_node)
            self.llm = LLM(**kwargs)
        client = self.llm.llm_engine.engine_core
        client._finalizer.detach()  # vLLM's own would destroy the training's world group
        self.shm_segment = _own_shm_segment()
        self._finalizer = weakref.finalize(self, _teardown, client, self._dir, self.shm_segment)
        self._logits = self._model().logits_processor
        if tp > 1:
            self.llm.apply_model(_mark_presharded)
        self.kv_cache_bytes = kv_bytes
        self.awake = True
        self.last_stats = RolloutStats()
        self.last_load_seconds = 0.0
        self.last_pack_seconds: Optional[float] = None
        self._plan: Optional[InPlaceLoader] = None
        self._plans: dict = {}  # (generation model, vocabulary rows, GEMM mode) -> its plan (None: reload)
        self._stream: Optional[VLLMStream] = None  # the streaming run in progress (stream())
        self.cpu_gemm: Optional[str] = None  # the CPU build's GEMM mode applied (rollout.vllm.cpu_gemm)
        if cuda and options.cpu_gemm != VLLMConfig.cpu_gemm:
            # ignored, not refused: one config file serves the CPU dev box and the GPU cluster
            LOG.warning("rollout.vllm.cpu_gemm=%s is ignored on GPU: it sets how vLLM's CPU build runs its linear "
                        "layers (its GPU build keeps the weights as loaded)", options.cpu_gemm)
        self.apply_cpu_gemm()
        if self.sleep_level:
            self.sleep()

    def _model(self) -> torch.nn.Module:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    # -------------------------------------------------------------- weights and memory
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Write ``weights`` (this rank's shards) into vLLM's model in place; returns the seconds it
        took. :class:`~hyflow.vllm_backend.weights.GenerationShards` go straight into vLLM's live
        weights where :func:`~hyflow.vllm_backend.inplace.plan_in_place` allows (planned at the
        first load), anything else through vLLM's reload (checkpoint names: its weight loaders and
        post-load processing). The prefix cache goes: its blocks hold keys and values of the old
        weights."""
        from vllm.config import set_current_vllm_config  # optional dependency (loaded by then)

        start = time.perf_counter()
        if self.sleep_level:
            self.llm.wake_up(tags=["weights"])
        self.apply_cpu_gemm()
        loader = self._in_place_loader(weights)
        if loader is not None:
            with set_current_vllm_config(self.llm.llm_engine.vllm_config):
                loader.load(weights.gen_model)
            self.last_pack_seconds = loader.pack_seconds
        else:
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
            if self.desc.tied_embeddings:
                self.llm.apply_model(_refresh_tied_head)
            if self.cpu_gemm is not None:  # the output layer's reload packed it whatever the mode
                with set_current_vllm_config(self.llm.llm_engine.vllm_config):
                    set_cpu_gemm(self._model(), self.cpu_gemm)
            self.last_pack_seconds = None
        if self.sleep_level:
            self.llm.wake_up(tags=["kv_cache"])
        if self._stream is None:  # a streaming run resets it once its requests are aborted (new_weights)
            self.llm.reset_prefix_cache()
        self.awake = True
        self.last_load_seconds = time.perf_counter() - start
        return self.last_load_seconds

    def apply_cpu_gemm(self) -> None:
        """CPU: put vLLM's linear layers in ``options.cpu_gemm``'s mode if they are not (at start, at
        the first load after the option changed, or when a bench switches modes before timing a
        load; :func:`~hyflow.vllm_backend.cpu_gemm.set_cpu_gemm`). A layer that switches holds no
        valid weights until the load that follows."""
        mode = self.options.cpu_gemm
        if self.cuda or mode == self.cpu_gemm:
            return
        from vllm.config import set_current_vllm_config  # optional dependency (loaded by then)

        with set_current_vllm_config(self.llm.llm_engine.vllm_config):
            set_cpu_gemm(self._model(), mode)
        self.cpu_gemm = mode

    def _in_place_loader(self, weights) -> Optional[InPlaceLoader]:
        """The planned in-place writer for ``weights``' generation model (None: vLLM's reload)."""
        if not (self.options.load_in_place and isinstance(weights, GenerationShards)):
            return None
        key = (id(weights.gen_model), weights.vocab_rows, self.cpu_gemm)
        if key not in self._plans:
            plan = plan_in_place(self._model(), self.llm.llm_engine.vllm_config, weights.gen_model, weights.desc,
                                 weights.vocab_rows, weights.tp_group)
            if isinstance(plan, str):
                LOG.warning("vLLM weights load through its reload path: %s", plan)
                plan = None
            self._plans[key] = plan
        self._plan = self._plans[key]
        return self._plan

    def sleep(self) -> None:
        """GPU: free the KV cache (and the weights at level 2, offload them at level 1)."""
        if self.sleep_level and self.awake:
            self.llm.sleep(level=self.sleep_level)
            self.awake = False

    # -------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, requests: Seq, sampling: Optional[SamplingConfig] = None,
                 request_offset: int = 0) -> RolloutResult:
        """Every sample of ``requests`` (token-id lists or ``GenerationRequest``), ordered by
        (request, sample), with hyflow's semantics (module docstring). Every rank of the replica
        calls it with the same requests."""
        from vllm.inputs import TokensPrompt  # optional dependency (loaded by then)

        start = time.perf_counter()
        seqs, truncated = self.prepare(requests, sampling, request_offset)
        by_temperature: dict[float, list] = {}
        for s in seqs:
            by_temperature.setdefault(float(s.params.temperature), []).append(s)
        for temperature, group in by_temperature.items():
            # the temperature lives in the logits (module docstring): raw log-probs are log_softmax(logits / T)
            self._logits.scale = 1.0 / temperature if temperature > 0 else 1.0
            params = [sampling_params(s, temperature > 0, delta=False) for s in group]
            prompts = [TokensPrompt(prompt_token_ids=s.prompt) for s in group]
            try:
                outputs = self.llm.generate(prompts, params, use_tqdm=False)
            finally:
                self._logits.scale = 1.0
            for s, result in zip(group, outputs):
                _fill(s, result.outputs[0])
        stats = RolloutStats(samples=len(seqs), truncated_prompts=truncated,
                             prompt_tokens=sum(len(s.prompt) for s in seqs),
                             generated_tokens=sum(len(s.out.token_ids) for s in seqs),
                             seconds=time.perf_counter() - start)
        self.last_stats = stats
        return RolloutResult(samples=[s.out for s in seqs], stats=stats)

    def prepare(self, requests: Seq, sampling: Optional[SamplingConfig] = None,
                request_offset: int = 0) -> tuple[list, int]:
        """``requests`` as scheduler sequences, one per sample, with hyflow's request semantics
        (:func:`hyflow.rollout.engine.prepare_requests`); returns (sequences, truncated prompts)."""
        return prepare_requests(requests, sampling or self.config.sampling, request_offset,
                                vocab_size=self.vocab_size, max_prompt_length=self.max_prompt_length,
                                max_seq_len=self.max_seq_len, truncate=self.config.truncate_long_prompts,
                                eos_token_ids=self.eos_token_ids)

    @torch.no_grad()
    def stream(self, feed: Callable, resume: Seq = (), *, max_new_tokens: int, max_sequences: Optional[int] = None,
               on_finish: Optional[Callable[[SampleOutput], None]] = None, version: Optional[int] = None,
               on_decode: Optional[Callable] = None, partial: str = "continue") -> RolloutStats:
        """:meth:`hyflow.rollout.engine.GenerationEngine.stream` on vLLM: run sequences (from
        :meth:`prepare`) as ``feed(run)`` supplies them, vLLM's ``max_num_seqs`` kept busy, until it
        returns none with nothing left to run; ``on_decode(run)`` after every engine step may load new
        weights and return their version (:class:`~hyflow.vllm_backend.stream.VLLMStream`: ``run`` is
        a :class:`hyflow.roles.GenerationRun`). ``resume``: sequences a checkpoint saved half way,
        continued first (``partial=abort``: restarted). Every sample is sampled at the rollout's
        temperature (``rollout.temperature``: vLLM's logits carry it for the whole run). Returns the
        run's counters. ``max_new_tokens``: each sequence's own budget applies (hyflow's engine sizes
        its cache with it; vLLM's was sized at start); ``max_sequences``: the most the feeder ever has
        running (fewer slots than vLLM's ``max_num_seqs`` then)."""
        del max_new_tokens
        temperature = float(self.config.sampling.temperature)
        todo = list(resume)
        if partial == "abort":
            for s in todo:
                s.out.token_ids, s.out.logprobs, s.out.versions = [], [], []
        stats = RolloutStats()

        def checked_feed(run):
            seqs = feed(run)
            for s in seqs:
                if float(s.params.temperature) != temperature:
                    raise ValueError(f"stream() samples at the rollout's temperature {temperature} only "
                                     f"(a sequence asks {s.params.temperature})")
            return seqs

        if self.sleep_level and not self.awake:
            self.llm.wake_up()
            self.awake = True
        slots = self.options.max_num_seqs or self.config.max_concurrent
        run = VLLMStream(self.llm.llm_engine, max(1, min(slots, max_sequences or slots)),
                         temperature > 0, version=version, partial=partial, on_finish=on_finish,
                         on_decode=on_decode, feed=checked_feed, reset_prefix_cache=self.llm.reset_prefix_cache,
                         stats=stats)
        self._logits.scale = 1.0 / temperature if temperature > 0 else 1.0
        self._stream = run
        try:
            run.run(todo)
        finally:
            self._stream = None
            self._logits.scale = 1.0
        self.last_stats = stats
        return stats

    def close(self) -> None:
        """Shut vLLM down (its groups too; the training's world stays) and remove its config folder."""
        self._finalizer()


def _fill(seq, completion) -> None:
    """``seq.out`` from vLLM's completion: tokens, log-probs, finish reason, stop token."""
    out = seq.out
    out.token_ids = list(completion.token_ids)
    out.logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, out.token_ids)] \
        if seq.params.logprobs else []
    fill_finish(seq, completion.finish_reason)
