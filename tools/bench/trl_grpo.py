"""TRL's GRPOTrainer at the settings of ``hyflow bench rl``'s issue-#16 command: the baseline
hyflow's step time is compared with, measured on the same machine back to back.

It runs in a separate environment that has TRL (hyflow does not depend on it) and hyflow
installed without dependencies, for the prompts and the reward rule only::

    python3.11 -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 trl==1.16.0
    trl-venv/bin/pip install --no-deps -e .
    hyflow convert mcore2hf --ckpt checkpoints/smollm2-135m --out smollm2-hf --dtype fp32
    cp checkpoints/smollm2-135m/tokenizer/* smollm2-hf/
    trl-venv/bin/python -m hyflow.tools.bench.trl_grpo --model smollm2-hf --steps 8 --warmup 1

Both sides then start from the same weights (the converted checkpoint), see the same 2-digit
addition chat prompts in the same order (hyflow's task generator and first-epoch shuffle at
``data.seed=1``) and score them with hyflow's ``numeric_match`` rule. Settings: 8 prompts x 4
samples per step, at most 64 new tokens, T=1, lr 5e-6 (``--lr 0`` samples every step from the
starting weights), no KL and no reference model (``beta=0``), token-mean loss (``loss_type='dapo'``, one
process), rewards scaled by the group's std, one optimizer step per generation round, constant lr
(hyflow's schedule; TRL's default decays to 0), sampling stopped at the same tokens as hyflow's
rollout (EOS and the chat format's end of turn), fp32,
one process with ``--threads`` intra-op threads, TRL's other defaults (gradient checkpointing on:
``--gradient-checkpointing off`` to compare without). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hyflow.data.loader import EpochSampler
from hyflow.data.tasks import make_task_rows
from hyflow.data.tokenizer import load_tokenizer
from hyflow.rewards.rules import numeric_match


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (weights and tokenizer)")
    p.add_argument("--steps", type=int, default=8, help="measured steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and left out of the medians")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the one process")
    p.add_argument("--seed", type=int, default=0, help="TRL's seed (sampling)")
    p.add_argument("--data-seed", type=int, default=1, help="hyflow's data.seed: which prompts, in which order")
    p.add_argument("--gradient-checkpointing", choices=("on", "off"), default="on",
                   help="TRL's GRPOConfig default is on (activations recomputed in the backward)")
    p.add_argument("--lr", type=float, default=5e-6,
                   help="learning rate (0 samples every step from the starting weights: compares the samplers)")
    p.add_argument("--output-dir", default="runs/trl_grpo")
    args = p.parse_args(argv)

    # optional: TRL and its datasets / transformers are not hyflow's dependencies (`--help` works without them)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    # hyflow's prompts in hyflow's order (data.seed=1: the task's draw and the loader's first-epoch
    # shuffle), fed to TRL unshuffled: step k of both runs sees the same 8 prompts
    rows = make_task_rows("arithmetic", 2000, seed=args.data_seed, ops="+", max_operand=99)
    order = EpochSampler(len(rows), 8, shuffle=True, seed=args.data_seed).order(0)
    data = Dataset.from_list([{"prompt": rows[i]["prompt"], "answer": rows[i]["reward_model"]["ground_truth"]}
                              for i in order])

    def reward(completions, answer, **_):
        return [numeric_match(c[-1]["content"], a) for c, a in zip(completions, answer)]

    # hyflow's rollout stops at EOS and the chat format's end-of-turn tokens (for SmolLM2
    # <|im_end|> and <|endoftext|>); TRL's generate stops at EOS only unless told the same
    stop_ids = load_tokenizer(args.model).stop_token_ids()
    steps = args.warmup + args.steps
    cfg = GRPOConfig(
        output_dir=args.output_dir, use_cpu=True, bf16=False, seed=args.seed, max_steps=steps,
        per_device_train_batch_size=32, gradient_accumulation_steps=1, num_generations=4, shuffle_dataset=False,
        max_completion_length=64, temperature=1.0, top_p=1.0, top_k=0, learning_rate=args.lr,
        beta=0.0, num_iterations=1, loss_type="dapo", scale_rewards="group",
        logging_steps=1, report_to="none", save_strategy="no", log_completions=False,
        gradient_checkpointing=args.gradient_checkpointing == "on",
        generation_kwargs={"eos_token_id": stop_ids}, lr_scheduler_type="constant")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                          processing_class=tokenizer)

    gen_s: list[float] = []
    score_s: list[float] = []

    def timed(fn, into):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            into.append(time.perf_counter() - t0)
            return out
        return wrapper

    trainer._generate = timed(trainer._generate, gen_s)
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, score_s)

    class Steps(TrainerCallback):
        def __init__(self):
            self.t0, self.rows = 0.0, []

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.rows.append({"step_s": time.perf_counter() - self.t0})

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and self.rows and "reward" in logs:
                self.rows[-1].update(reward=logs["reward"],
                                     response_length=logs.get("completions/mean_length"))

    steps_cb = Steps()
    trainer.add_callback(steps_cb)
    trainer.train()

    print("| step | wall s | generate s | generate+score s | the rest s | reward | response length |")
    print("|---|---|---|---|---|---|---|")
    out = []
    for i, row in enumerate(steps_cb.rows):
        row.update(step=i + 1, generate_s=gen_s[i], score_s=score_s[i],
                   rest_s=row["step_s"] - score_s[i])
        out.append(row)
        tag = " (warm-up)" if i < args.warmup else ""
        print(f"| {i + 1}{tag} | {row['step_s']:.2f} | {row['generate_s']:.2f} | {row['score_s']:.2f} "
              f"| {row['rest_s']:.2f} | {row.get('reward', float('nan')):.3f} "
              f"| {row.get('response_length') or float('nan'):.1f} |")
    measured = out[args.warmup:]

    def med(key):
        return statistics.median(r[key] for r in measured)

    summary = {"bench": "trl_grpo", "threads": args.threads, "steps": len(measured), "stop_token_ids": stop_ids,
               "gradient_checkpointing": args.gradient_checkpointing,
               "median_step_s": med("step_s"), "median_generate_s": med("generate_s"),
               "median_rest_s": med("rest_s"),
               "response_tokens_per_step": statistics.mean(32 * (r.get("response_length") or 0)
                                                           for r in measured),
               "rewards": [r.get("reward") for r in out], "lengths": [r.get("response_length") for r in out]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
