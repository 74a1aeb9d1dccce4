"""Independent references that parity tests compare hyflow against (Hugging Face models)."""
from __future__ import annotations

from typing import Any


def hf_response_logprobs(hf: Any, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """Log-probs of ``response`` after ``prompt`` under ``softmax(logits / temperature)`` of the HF
    causal LM ``hf``, from one full forward of prompt + response (no KV cache)."""
    import torch

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    idx = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[idx, torch.tensor(response)].tolist()
