"""Small files that tests build on the fly (no model hub at test time)."""
from __future__ import annotations

from hyflow.parallel.layout import Layout
from hyflow.rollout.config import GenerationConfig, SamplingConfig

#: The words of :func:`write_tiny_hf_tokenizer`'s vocabulary, in id order.
TINY_HF_WORDS = ("<unk>", "<eos>", "<|im_start|>", "<|im_end|>", "user", "assistant", "what", "is", "2", "+",
                 "3", "?")


def write_tiny_hf_tokenizer(path: str) -> str:
    """Save a 12-word, whitespace-split HF fast tokenizer with an im_start/im_end chat template
    to the directory ``path``; returns ``path``."""
    # optional dependency (transformers, tokenizers): test fixtures only
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_HF_WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    tok.save_pretrained(path)
    return path


def engine_greedy_tokens(model_dir: str, prompts: list, new_tokens: int, tp: int = 2) -> list:
    """Rank function: hyflow's generation engine's greedy tokens (``new_tokens`` each, EOS ignored) for
    ``prompts`` on the model checkpoint ``model_dir`` at ``tp`` (the reference HF exports are compared to)."""
    # Megatron (seconds) only when a test loads a checkpoint: importing this helper stays light
    from hyflow.checkpoint.model import load_model_from_checkpoint
    from hyflow.parallel.groups import init_training_groups
    from hyflow.rollout.engine import GenerationEngine

    groups = init_training_groups(Layout(tp=tp))
    model, desc, _ = load_model_from_checkpoint(model_dir, groups)
    model.eval()
    config = GenerationConfig(sampling=SamplingConfig(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    engine = GenerationEngine.from_description(model, desc, config, tp_group=groups.pgs.tp)
    return [s.token_ids for s in engine.generate(prompts).samples]
