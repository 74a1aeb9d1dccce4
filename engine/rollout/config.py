"""Configuration of the rollout engine (light module: no torch import).

Each setting is declared once:

* :class:`ResponseSettings`: *how one response is drawn* (temperature, top-k, top-p, n, length,
  stop tokens); :class:`SamplingConfig`, a request's settings, adds its seed, EOS ids and flags;
* :class:`EngineSettings`: *how the engine admits and batches prompts* (prompt length, chunked
  prefill, concurrent sequences); :class:`GenerationConfig`, the engine's settings, adds the
  context limit, batching policy, layer implementation and the default request;
* :class:`GenerationSettings`, both halves: what a user sets, the RL job's ``rollout`` section
  (:class:`hyflow.jobs.rl_config.RolloutConfig` extends it with the job's own keys and defaults).
  :meth:`GenerationConfig.from_settings` splits it into the engine's two halves by the fields
  declared here.

All validate themselves and raise :class:`hyflow.config.ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hyflow.config import ConfigError

BatchingPolicy = Literal["continuous", "static"]


@dataclass
class ResponseSettings:
    """How each response is drawn (the keys a user sets; a request adds its own, :class:`SamplingConfig`)."""

    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (0 = greedy)"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0 = off)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1 = off)"})
    n: int = field(default=1, metadata={"unit": "responses per prompt", "help": "responses sampled per prompt"})
    max_new_tokens: int = field(default=256, metadata={"unit": "tokens", "help": "longest response in tokens"})
    stop_token_ids: list[int] = field(default_factory=list,
                                      metadata={"help": "extra stop ids besides the EOS ids"})


@dataclass
class EngineSettings:
    """How the engine admits and batches prompts (the keys a user sets; the engine adds its own,
    :class:`GenerationConfig`)."""

    max_prompt_length: Optional[int] = field(default=None, metadata={
        "unit": "tokens",
        "help": "longest prompt in tokens (None = max_seq_len - 1); longer prompts are an error "
                "unless truncate_long_prompts"})
    truncate_long_prompts: bool = field(default=False, metadata={
        "help": "keep the last max_prompt_length tokens of longer prompts instead of refusing them "
                "(the RL dataset drops them otherwise; the count is logged)"})
    prefill_chunk_size: int = field(default=0, metadata={
        "unit": "tokens",
        "help": "prefill long prompts in chunks of this many tokens (0 = whole prompt)"})
    max_concurrent: int = field(default=64, metadata={
        "unit": "sequences per generation replica",
        "help": "sequences decoded at once per replica (KV-cache slots)"})


@dataclass
class SamplingConfig(ResponseSettings):
    """How responses are sampled; also usable per request (see ``GenerationRequest``).

    The processing order is the one of Hugging Face ``generate``: logits are divided
    by ``temperature``, then ``top_k`` keeps the k largest, then ``top_p`` keeps the
    smallest set of most likely tokens whose probability reaches ``top_p`` (after
    renormalising over the top-k set). Tokens tied with the last kept one are kept.
    Padded vocabulary rows (Megatron pads the vocabulary to a TP multiple) are never
    sampled.

    Log-probs (``logprobs=True``) are ``log_softmax(logits / T)`` of the sampled token
    over the whole vocabulary, *before* top-k / top-p truncation, with ``T = temperature``
    (``T = 1`` for greedy): what the trainer recomputes for PPO's ratio with the same
    temperature, so the rollout's values can serve as the old log-probs.
    """

    seed: int = field(default=0, metadata={
        "help": "base seed; request i sample j draws from a stream keyed by (seed, i, j)"})
    eos_token_ids: Optional[list[int]] = field(default=None, metadata={
        "help": "end-of-sequence ids (None = the model description's)"})
    ignore_eos: bool = field(default=False, metadata={
        "help": "never stop on EOS / stop ids (benchmarks: always max_new_tokens)"})
    include_stop_token: bool = field(default=True, metadata={
        "help": "keep the stop token at the end of the response (masked in, with its log-prob)"})
    logprobs: bool = field(default=True, metadata={"help": "return log-probs of sampled tokens"})

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax decoding."""
        return self.temperature == 0

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ConfigError(f"must be >= 0, got {self.temperature!r}", key="temperature")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"must be an integer >= 0, got {self.top_k!r}", key="top_k")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.top_p!r}", key="top_p")
        for name in ("n", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"must be an integer >= 1, got {value!r}", key=name)
        for name in ("eos_token_ids", "stop_token_ids"):
            ids = getattr(self, name) or []
            if any(not isinstance(t, int) or t < 0 for t in ids):
                raise ConfigError(f"token ids must be integers >= 0, got {ids!r}", key=name)

    def replace(self, **changes: Any) -> "SamplingConfig":
        """A validated copy with ``changes`` applied."""
        out = dataclasses.replace(self, **changes)
        out.validate()
        return out


@dataclass
class GenerationConfig(EngineSettings):
    """How the engine runs a batch of requests on one generation replica.

    Continuous batching keeps ``max_concurrent`` sequences in flight: a finished
    sequence frees its KV-cache slot at once and the next pending sequence is
    prefilled into it, so no forward is spent on finished rows. ``static`` runs
    fixed batches to completion (finished rows are dropped from the forward, but
    slots stay empty until the whole batch is done); it exists for comparison.
    """

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_seq_len: Optional[int] = field(default=None, metadata={
        "help": "context limit prompt + response (None = the model's context length: "
                "max_position_embeddings, extended by its RoPE scaling)"})
    max_prefill_tokens: int = field(default=8192, metadata={
        "help": "padded prompt tokens per prefill forward (bounds activation memory)"})
    batching: BatchingPolicy = field(default="continuous", metadata={
        "help": "continuous (refill freed slots) or static (fixed batches)"})
    share_prompt_prefill: bool = field(default=True, metadata={
        "help": "prefill a prompt once and copy its KV cache to its n samples"})
    pad_token_id: int = field(default=0, metadata={"help": "pad id of the returned tensors"})
    layer_impl: Literal["auto", "lean", "megatron"] = field(default="auto", metadata={
        "help": "transformer layers: megatron (Megatron's TransformerBlock), lean (the same modules' "
                "weights without Megatron's per-layer Python; standard Llama blocks only), auto"})
    record_routing: bool = field(default=False, metadata={
        "help": "mixture-of-experts models: record each fed token's experts per layer (SampleOutput.routing, "
                "for routing replay)"})
    cpu_weight_packing: bool = field(default=True, metadata={
        "help": "CPU + fp32 only: run decode GEMMs through oneDNN on weights packed at the start of "
                "each generate call (one extra copy of the linear weights while generating)"})

    def validate(self) -> None:
        self.sampling.validate()
        for name in ("max_concurrent", "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"must be an integer >= 1, got {value!r}", key=name)
        for name in ("max_seq_len", "max_prompt_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"must be null or an integer >= 1, got {value!r}", key=name)
        if self.max_seq_len is not None and self.max_prompt_length is not None \
                and self.max_prompt_length >= self.max_seq_len:
            raise ConfigError(
                f"max_prompt_length={self.max_prompt_length} leaves no room for a response "
                f"within max_seq_len={self.max_seq_len}", key="max_prompt_length")
        if not isinstance(self.prefill_chunk_size, int) or self.prefill_chunk_size < 0:
            raise ConfigError(f"must be an integer >= 0, got {self.prefill_chunk_size!r}",
                              key="prefill_chunk_size")
        if self.layer_impl not in ("auto", "lean", "megatron"):
            raise ConfigError(f"must be auto, lean or megatron, got {self.layer_impl!r}", key="layer_impl")
        if self.batching not in ("continuous", "static"):
            raise ConfigError(f"must be 'continuous' or 'static', got {self.batching!r}",
                              key="batching")

    @classmethod
    def from_settings(cls, settings: "GenerationSettings", **overrides: Any) -> "GenerationConfig":
        """The engine's config for a user's ``settings`` (the RL job's ``rollout`` section): its
        response fields into the default request, its engine fields here; ``overrides``: engine
        fields the caller knows (``pad_token_id``). Validated."""
        sampling = {f.name: getattr(settings, f.name) for f in dataclasses.fields(ResponseSettings)}
        engine = {f.name: getattr(settings, f.name) for f in dataclasses.fields(EngineSettings)}
        cfg = cls(sampling=SamplingConfig(**sampling), **engine, **overrides)
        cfg.validate()
        return cfg


def redefault(settings: type, name: str, default: Any) -> Any:
    """The field ``name`` of ``settings`` (its help) with another default, for a section that
    extends the settings and starts elsewhere (the RL job's ``rollout``)."""
    return field(default=default, metadata=settings.__dataclass_fields__[name].metadata)


@dataclass
class GenerationSettings(ResponseSettings, EngineSettings):
    """The generation settings a user sets, each declared once: how responses are drawn
    (:class:`ResponseSettings`) and how the engine admits and batches prompts
    (:class:`EngineSettings`). The RL job's ``rollout`` section extends it."""

    def validate(self) -> None:
        GenerationConfig.from_settings(self)  # the engine's own checks, naming the key
