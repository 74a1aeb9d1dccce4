"""The multi-turn rollout loop with a scripted "model" (no network weights): turns and tools,
budgets and end reasons, environments with per-turn rewards, failures (retried, or the group
dropped and counted), a step that never waits past its timeouts, tools running while other
samples still decode, random streams independent of the replica split, the leader's results
shared over a replica's ranks, and the metrics."""

import time

import pytest
import torch

from hyflow.agent.agent import MultiTurnAgent
from hyflow.agent.config import END_REASONS, MultiTurnConfig
from hyflow.agent.environment import EnvStep, Environment
from hyflow.agent.metrics import trajectory_metrics
from hyflow.agent.trajectory import STATS, final_turns
from hyflow.data.dataset import PromptDataset
from hyflow.data.tokenizer import CharTokenizer
from hyflow.rl.metrics import BatchStats
from hyflow.rollout.config import SamplingConfig
from hyflow.testing import run_on_ranks
from hyflow.testing.agent import ScriptedTurns

TOK = CharTokenizer()
EOS = TOK.eos_token_id
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


def _records(questions):
    rows = [{"prompt": q, "data_source": "t", "reward_model": {"ground_truth": "0"}} for q in questions]
    return list(PromptDataset.from_rows(rows, TOK, max_prompt_length=400))


def _agent(**kw):
    kw = dict(dict(enable=True, tools=["calculator"], observation_role="user", max_turns=4, max_response_tokens=300),
              **kw)
    cfg = MultiTurnConfig(**kw)
    cfg.validate()
    return MultiTurnAgent(cfg, TOK)


def _ids(text):
    return TOK.encode(text) + [EOS]


def _run(agent, script, records, n=2, max_new=120, delay=0.0, seed=1, max_seq_len=4096):
    gen = ScriptedTurns(lambda ctx, j: (lambda ids: (ids, [-0.1] * len(ids)))(script(TOK.decode(ctx, False), j)),
                        stop_ids=[EOS], max_seq_len=max_seq_len, delay=delay)
    samples = agent.rollout(gen, records, n, seed=seed, request_offset=0, sampling=SamplingConfig(max_new_tokens=max_new),
                            max_seq_len=max_seq_len, device=torch.device("cpu"))
    return samples, gen


def _stat(samples, name):
    return samples.stats[:, STATS.index(name)].tolist()


def _ends(samples):
    return [END_REASONS[int(e)] for e in _stat(samples, "end")]


def calc_then_answer(ctx, j):
    """Calls the calculator until it has a result, then answers with it."""
    if "6*7" not in ctx:
        return _ids(CALL % "6*7")
    return _ids("it is " + ctx.rsplit("<|user|>", 1)[-1].split("<|assistant|>")[0])


def test_tool_turns_and_end_reasons():
    agent = _agent()
    samples, gen = _run(agent, calc_then_answer, _records(["q1?", "q2?"]))
    assert _ends(samples) == ["done"] * 4
    assert _stat(samples, "turns") == [2] * 4 and _stat(samples, "tool_calls") == [1] * 4
    assert [TOK.decode(t) for t in final_turns(samples)] == ["it is 42"] * 4
    assert len(gen.calls) == 2 and gen.calls[0][2] == 2  # turn 1: one request per prompt (shared prefill)

    looping = _run(_agent(max_turns=3), lambda ctx, j: _ids(CALL % "1+1"), _records(["q"]), n=1)[0]
    assert _ends(looping) == ["max_turns"] and _stat(looping, "turns") == [3] and _stat(looping, "tool_calls") == [3]
    assert TOK.decode(looping.tokens, False).count("<|user|>2<|assistant|>") == 2  # the last call: counted, not run
    cut = _run(_agent(), lambda ctx, j: TOK.encode("x" * 500), _records(["q"]), n=1, max_new=50)[0]
    assert _ends(cut) == ["turn_length"] and cut.meta[0, 4] == 2  # counted as truncated
    budget = _run(_agent(max_response_tokens=150), lambda ctx, j: _ids(CALL % "1+1"), _records(["q"]), n=1)[0]
    assert _ends(budget) == ["token_budget"] and budget.meta[0, 3] <= 150
    ctx = _run(_agent(), lambda ctx, j: _ids(CALL % "1+1"), _records(["q"]), n=1, max_seq_len=620)[0]
    assert _ends(ctx) == ["context_limit"] and ctx.meta[0, 2] + ctx.meta[0, 3] <= 620 and _stat(ctx, "turns")[0] >= 1


def test_observations_are_masked_and_bad_calls_are_seen():
    agent = _agent()
    script = lambda ctx, j: _ids('<tool_call>{"name": "calc"}</tool_call>') if "unknown" not in ctx else _ids("ok")
    samples, _ = _run(agent, script, _records(["q"]), n=1)
    (out,) = samples.to_outputs()
    text = TOK.decode(out.token_ids, skip_special_tokens=False)
    assert "Error: unknown tool 'calc' (tools: calculator)" in text
    mask = samples.mask.tolist()
    observation = [t for t, m in zip(out.token_ids, mask) if m == 0]
    assert TOK.decode(observation).startswith("Error: unknown tool") and _stat(samples, "tool_errors") == [1]
    assert [lp for lp, m in zip(samples.logprobs.tolist(), mask) if m == 0] == [0.0] * len(observation)


class Game(Environment):
    """Guess a number from 1 to 9: "higher" / "lower" from a simulated user, reward 1 for the hit,
    -0.1 per miss."""

    def reset(self, record):
        self.secret = int(record.messages[0]["content"][-1])
        return [{"role": "user", "content": "guess 1-9"}]

    def step(self, turn):
        guess = int(turn.text.strip()[-1])
        if guess == self.secret:
            return EnvStep(reward=1.0, done=True)
        return EnvStep([{"role": "user", "content": "higher" if guess < self.secret else "lower"}], reward=-0.1)


def test_environment_with_per_turn_rewards():
    agent = _agent(tools=[], environment=f"{__name__}:Game", reward="environment", max_turns=9)

    def bisect(ctx, j):  # a perfect player: keeps an interval from the feedback
        lo, hi = 1, 9
        guesses = ctx.split("<|assistant|>")[1:]
        for g, fb in zip(guesses, ctx.split("<|user|>")[2:]):
            value = int(g[0])
            lo, hi = (value + 1, hi) if fb.startswith("higher") else (lo, value - 1)
        return _ids(str((lo + hi) // 2))

    records = _records(["secret 7", "secret 5"])
    samples, _ = _run(agent, bisect, records, n=1)
    assert _ends(samples) == ["done", "done"]
    assert _stat(samples, "turns") == [2, 1]  # 5 -> "higher" -> 7; 5 at once
    assert _stat(samples, "env_reward") == pytest.approx([0.9, 1.0])
    scores, batch = agent.score(None, records, 0, samples)
    assert scores.tolist() == pytest.approx([0.9, 1.0]) and batch.scores == pytest.approx([0.9, 1.0])


class Flaky(Environment):
    """Fails the first ``fail`` steps of the prompts whose text contains "flaky" (across instances)."""

    failures = {}

    def reset(self, record):
        self.key = record.messages[0]["content"]
        return record.messages

    def step(self, turn):
        if "flaky" in self.key and Flaky.failures.get(self.key, 0) < self.fail:
            Flaky.failures[self.key] = Flaky.failures.get(self.key, 0) + 1
            raise ConnectionError("the environment's server went away")
        return EnvStep(done=True, reward=1.0)


class FlakyOnce(Flaky):
    fail = 1


class FlakyAlways(Flaky):
    fail = 10**9


class Hang(Environment):
    def step(self, turn):
        time.sleep(3600)


class BrokenInit(Environment):
    def __init__(self):
        raise OSError("cannot reach the game server")


@pytest.mark.parametrize("policy", ["retry", "resample_group"])
def test_failures_are_retried(policy):
    Flaky.failures.clear()
    agent = _agent(tools=[], environment=f"{__name__}:FlakyOnce", reward="environment", failure_policy=policy)
    samples, _ = _run(agent, lambda ctx, j: _ids("a"), _records(["flaky one", "fine"]), n=2)
    assert _ends(samples) == ["done"] * 4 and _stat(samples, "dropped") == [0] * 4
    # retry: only the failed trajectory ran again; resample_group: its whole group did
    assert _stat(samples, "attempts") == ([1, 0, 0, 0] if policy == "retry" else [1, 1, 0, 0])
    assert _stat(samples, "env_reward") == [1.0] * 4


def test_a_group_that_keeps_failing_is_dropped_not_trained_on():
    Flaky.failures.clear()
    agent = _agent(tools=[], environment=f"{__name__}:FlakyAlways", reward="environment", max_retries=2)
    records = _records(["flaky one", "fine"])
    samples, _ = _run(agent, lambda ctx, j: _ids("a"), records, n=2)
    assert _stat(samples, "dropped") == [1, 1, 0, 0]  # the whole group, never a partial one
    assert _ends(samples)[:2] in (["failed", "failed"], ["failed", "done"])
    assert _stat(samples, "attempts")[0] == 2
    assert samples.mask[:int(samples.meta[0, 3] + samples.meta[1, 3])].sum() == 0  # no loss on the group
    scores, _ = agent.score(None, records, 0, samples)
    assert scores.tolist() == [0.0, 0.0, 1.0, 1.0]
    stats = BatchStats(torch.device("cpu"))
    trajectory_metrics(stats, samples, 2)
    out = stats.reduce(None)
    assert out["multi_turn/dropped_groups"] == 1.0 and out["multi_turn/retries"] >= 2


def test_a_hung_environment_fails_within_its_timeout():
    agent = _agent(tools=[], environment=f"{__name__}:Hang", env_timeout=0.5, max_retries=1)
    start = time.monotonic()
    samples, _ = _run(agent, lambda ctx, j: _ids("a"), _records(["q"]), n=2)
    assert time.monotonic() - start < 5
    assert _stat(samples, "dropped") == [1, 1]
    broken = _agent(tools=[], environment=f"{__name__}:BrokenInit", max_retries=0)
    samples, _ = _run(broken, lambda ctx, j: _ids("a"), _records(["q"]), n=2)
    assert _stat(samples, "dropped") == [1, 1] and _ends(samples) == ["failed", "failed"]


def test_hung_and_flooding_tools_inside_a_rollout(tmp_path):
    (tmp_path / "bad_tools.py").write_text(
        "import time\nfrom hyflow.agent.tools import Tool\n"
        "class Sleep(Tool):\n    def execute(self, arguments):\n        time.sleep(3600)\n"
        "class Spam(Tool):\n    def execute(self, arguments):\n        return 'y' * 10_000_000\n"
        "class Boom(Tool):\n    def execute(self, arguments):\n        raise KeyError('no such key')\n")
    schema = "\n    tool_schema: {type: function, function: {name: %s, parameters: {type: object, properties: {}}}}"
    (tmp_path / "tools.yaml").write_text("tools:\n" + "".join(
        f"  - class_name: {tmp_path / 'bad_tools.py'}:{cls}" + schema % name + "\n"
        for cls, name in (("Sleep", "sleep"), ("Spam", "spam"), ("Boom", "boom"))))
    agent = _agent(tools=["python"], tool_config_path=str(tmp_path / "tools.yaml"), tool_timeout=1.0,
                   max_tool_response_length=200, max_response_tokens=2000, max_turns=2)
    code = "import os\\nprint(os.listdir('%s'))" % tmp_path
    calls = {0: '<tool_call>{"name": "sleep", "arguments": {}}</tool_call>',
             1: '<tool_call>{"name": "spam", "arguments": {}}</tool_call>',
             2: '<tool_call>{"name": "boom", "arguments": {}}</tool_call>',
             3: '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>' % code}
    start = time.monotonic()
    script = lambda ctx, j: _ids(calls[j]) if ctx.count("<|assistant|>") == 1 else _ids("ok")  # noqa: E731
    samples, _ = _run(agent, script, _records(["q"]), n=4, max_new=400)
    assert time.monotonic() - start < 10  # one tool timeout, not one per call, not forever
    assert _stat(samples, "tool_timeouts") == [1, 0, 0, 0] and _stat(samples, "tool_errors") == [1, 0, 1, 1]
    texts = [TOK.decode(o.token_ids) for o in samples.to_outputs()]
    assert "timed out after 1 s" in texts[0] and "characters cut" in texts[1] and "KeyError" in texts[2]
    assert "outside the sandbox" in texts[3] and "bad_tools.py" not in texts[3]
    assert max(samples.meta[:, 3].tolist()) < 700  # 10 MB never reached the context


class Clock(Environment):
    started: list = []

    def step(self, turn):
        Clock.started.append(time.monotonic())
        return EnvStep(done=True)


def test_tools_run_while_other_samples_decode():
    """The first sample's environment step (its tool calls) starts when its turn is done, not when
    the whole wave is."""
    Clock.started.clear()
    agent = _agent(tools=[], environment=f"{__name__}:Clock")
    samples, gen = _run(agent, lambda ctx, j: _ids("a"), _records(["q"]), n=4, delay=0.3)
    (start, end, _), = gen.calls
    assert len(Clock.started) == 4 and min(Clock.started) < end - 0.5  # ~0.9 s before the wave ended


def test_random_streams_do_not_depend_on_the_replica_split():
    seen = {}

    def script(ctx, j):
        return _ids("a") if ctx.count("<|assistant|>") == 1 else _ids("b")

    class Recorder(ScriptedTurns):
        def generate(self, requests, on_finish=None):
            for r in requests:
                seen.setdefault(self.tag, []).append((TOK.decode(r.prompt_ids)[:8], r.seed, r.sampling.n))
            return super().generate(requests, on_finish)

    agent = _agent(tools=[], environment=f"{__name__}:Game", max_turns=2)
    records = _records(["secret 1", "secret 2", "secret 3", "secret 4"])
    for tag, parts in (("whole", [(0, 4)]), ("split", [(0, 2), (2, 4)])):
        for a, b in parts:
            gen = Recorder(lambda ctx, j: (lambda ids: (ids, [0.0] * len(ids)))(script(TOK.decode(ctx, False), j)), [EOS])
            gen.tag = tag
            agent.rollout(gen, records[a:b], 2, seed=5, request_offset=a, sampling=SamplingConfig(max_new_tokens=9),
                          max_seq_len=4096, device=torch.device("cpu"))
    assert sorted(seen["whole"]) == sorted(seen["split"]) and len({s for _, s, _ in seen["whole"]}) == 4 + 8


def _replica(calls_file):
    """Two ranks form one replica: rank 0 (the leader) runs the environments, rank 1 gets the results."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    agent = _agent()
    records = _records(["q1?", "q2?"])
    counted = []
    runner = agent.toolbox.runner
    original = runner.run
    runner.run = lambda calls: counted.append(len(calls)) or original(calls)
    gen = ScriptedTurns(lambda ctx, j: (lambda ids: (ids, [-0.1] * len(ids)))(calc_then_answer(TOK.decode(ctx, False), j)),
                        [EOS])
    samples = agent.rollout(gen, records, 2, seed=1, request_offset=0, sampling=SamplingConfig(max_new_tokens=120),
                            max_seq_len=4096, device=torch.device("cpu"), replica_groups=[group])
    return samples.tokens.tolist(), samples.mask.tolist(), samples.stats.tolist(), len(counted)


@pytest.mark.multirank
def test_the_leader_runs_the_tools_and_shares_the_results():
    (tok0, mask0, stats0, calls0), (tok1, mask1, stats1, calls1) = run_on_ranks(_replica, 2, None)
    assert (tok0, mask0, stats0) == (tok1, mask1, stats1)
    assert (calls0, calls1) == (4, 0)


def test_metrics():
    agent = _agent()
    samples, _ = _run(agent, calc_then_answer, _records(["q1?"]), n=2)
    stats = BatchStats(torch.device("cpu"))
    trajectory_metrics(stats, samples, 2)
    out = stats.reduce(None)
    assert out["num_turns/mean"] == 2 and out["multi_turn/tool_calls/mean"] == 1
    assert out["multi_turn/tool_call_rate"] == 1.0 and out["multi_turn/end_reason/done"] == 1.0
    obs = sum(_stat(samples, "observation_tokens"))
    gen = sum(_stat(samples, "generated_tokens"))
    assert out["multi_turn/observation_token_share"] == pytest.approx(obs / (obs + gen))
    assert out["multi_turn/turn_response_length"] == pytest.approx(gen / 4)
    assert gen == samples.mask.sum() and obs + gen == samples.meta[:, 3].sum()


def test_a_saved_trajectory_replays_into_a_fresh_environment():
    """An async checkpoint's in-flight trajectory resumes by replaying its assistant turns into a new
    environment (:meth:`MultiTurnRollout.replay`): the same environment answers with the saved
    observations; one that answers otherwise is named (such a resume would not be exact)."""
    from hyflow.agent.rollout import EngineTurns, Live, MultiTurnRollout
    from hyflow.testing.agent import EchoUser

    agent = _agent(tools=[], environment="hyflow.testing.agent:EchoUser", max_turns=3)
    gen = ScriptedTurns(lambda ctx, j: (_ids(f"turn {j}"), [-0.1] * len(_ids(f"turn {j}"))), stop_ids=[EOS])
    records = _records(["1+1?"])

    def driver(reply):
        return MultiTurnRollout(agent.cfg, agent.chat, TOK, EngineTurns(gen), SamplingConfig(max_new_tokens=40),
                                4096, lambda: EchoUser(turns=3, reply=reply))

    trajs = driver("again").run(records, 2, seed=3)
    t = trajs[0]
    assert t.turns == 3 and [k for k, *_ in t.segments].count("observation") == 2
    assert driver("again").replay(t, Live(), records[0], [EOS] * t.turns) is None
    assert "another observation" in driver("other").replay(t, Live(), records[0], [EOS] * t.turns)
