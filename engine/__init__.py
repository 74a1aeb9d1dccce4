"""hyflow: RL post-training on Megatron-Core."""
import warnings as _warnings

__version__ = "0.1.0"

# Megatron-Core announces at import time every optional fast path (Apex, Transformer
# Engine) it falls back from; without a GPU those fallbacks are the expected setup.
for _message in (r".*Transformer Engine and Apex are not installed.*",
                 r".*Apex is not installed.*",
                 r".*full scope is deprecated.*"):
    _warnings.filterwarnings("ignore", message=_message)
