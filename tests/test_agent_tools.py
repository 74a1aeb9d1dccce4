"""Tools of multi-turn rollouts: parsing the model's calls, the calculator, schemas and verl's tool
YAML, the runner's timeouts and caps, and the sandboxed Python executor (faults and escapes)."""

import os
import textwrap
import time

import pytest

from hyflow.agent.calculator import Calculator, calculate
from hyflow.agent.executor import ToolRunner, truncate
from hyflow.agent.parsers import HermesParser, make_parser
from hyflow.agent.sandbox import PythonTool, network_namespace_prefix, run_python
from hyflow.agent.tools import Tool, ToolConfigError, ToolFailure, function_schema, load_tool_config


class Sleeper(Tool):
    @classmethod
    def default_schema(cls):
        return function_schema("sleep", "sleeps forever", {}, [])

    def execute(self, arguments):
        time.sleep(3600)


class Raiser(Tool):
    @classmethod
    def default_schema(cls):
        return function_schema("boom", "raises", {"x": {"type": "integer"}}, ["x"])

    def execute(self, arguments):
        raise RuntimeError(f"exploded on {arguments['x']}")


class Printer(Tool):
    @classmethod
    def default_schema(cls):
        return function_schema("spam", "returns 10 MB", {}, [])

    def execute(self, arguments):
        return "x" * 10_000_000


class Broken(Tool):
    @classmethod
    def default_schema(cls):
        return function_schema("broken", "its backend is down", {}, [])

    def execute(self, arguments):
        raise ToolFailure("backend unreachable")


def _calls(text):
    return HermesParser().parse(text)


def test_hermes_parser_reads_calls_and_names_what_is_malformed():
    calls = _calls('a <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> b '
                   '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "1+2"}, None),
                                                               ("f", {"x": 1}, None)]
    assert _calls("no calls here") == []
    bad = _calls('<tool_call>{"name": "f", "arguments": {1}}</tool_call><tool_call>[1]</tool_call>'
                 '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "g"')
    assert [c.error.split(" (")[0] for c in bad] == [
        "the tool call is not valid JSON", "a tool call must be a JSON object, got list",
        'a tool call needs "name": the tool\'s name as a string', "<tool_call> is not closed by </tool_call>"]


def test_parser_plugs_in_by_spec(tmp_path):
    path = tmp_path / "my_parser.py"
    path.write_text(textwrap.dedent("""
        from hyflow.agent.parsers import ToolCall
        class Bang:
            def parse(self, text):
                return [ToolCall(name=w[1:]) for w in text.split() if w.startswith("!")]
    """))
    parser = make_parser(f"{path}:Bang")
    assert [c.name for c in parser.parse("call !calculator now")] == ["calculator"]
    with pytest.raises(ValueError, match="defines no 'Nope'"):
        make_parser(f"{path}:Nope")


def test_calculator():
    assert calculate("347*28") == "9716"
    assert calculate("(2+3)^2 - 10/4") == "22.5"
    assert calculate("7 // 2 + 7 % 2") == "4"
    for bad, why in (("9**9**9", "exponents"), ("1/0", "division by zero"), ("__import__('os')", "unsupported"),
                     ("2 +", "cannot parse"), ("10**64 * 10**64", "digits")):
        with pytest.raises(ValueError, match=why):
            calculate(bad)
    assert Calculator().execute({"expression": "1/0"}).error


def test_tool_yaml_in_verls_shape(tmp_path):
    (tmp_path / "weather.py").write_text(textwrap.dedent("""
        from hyflow.agent.tools import Tool
        class Weather(Tool):
            def execute(self, arguments):
                return f"{self.config['unit']}: sunny in {arguments['city']}"
    """))
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(f"""
        tools:
          - class_name: "{tmp_path / 'weather.py'}:Weather"
            config: {{unit: C}}
            tool_schema:
              type: function
              function:
                name: get_weather
                description: "current weather"
                parameters:
                  type: object
                  properties: {{city: {{type: string, description: city}}}}
                  required: [city]
          - class_name: hyflow.agent.calculator.Calculator
            config: {{}}
    """))
    weather, calc = load_tool_config(str(path))
    assert (weather.name, calc.name) == ("get_weather", "calculator")
    runner = ToolRunner([weather, calc])
    out = runner.run(_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
                            '<tool_call>{"name": "get_weather", "arguments": {"town": "Oslo"}}</tool_call>'
                            '<tool_call>{"name": "get_weather", "arguments": {"city": 3}}</tool_call>'))
    assert out[0].text == "C: sunny in Oslo" and not out[0].error
    assert "missing required argument 'city'" in out[1].text and "unknown argument 'town'" in out[1].text
    assert "must be of type string" in out[2].text
    for text, why in (("tools: []", "non-empty list"), ("tools:\n  - {config: {}}", "missing class_name"),
                      ("tools:\n  - {class_name: nope.Nope}", "importing 'nope' failed"),
                      ("tools:\n  - {class_name: hyflow.agent.calculator.Calculator, extra: 1}", "unknown key"),
                      ("tools:\n  - class_name: hyflow.agent.calculator.Calculator\n    tool_schema: {type: x}",
                       "tool_schema must be")):
        path.write_text(text)
        with pytest.raises(ToolConfigError, match=why):
            load_tool_config(str(path))


def test_bad_calls_become_error_observations():
    runner = ToolRunner([Calculator(), Raiser(), Broken()], timeout=5, max_parallel_calls=3)
    out = runner.run(_calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                            '<tool_call>{"name": "boom", "arguments": {"x": 3}}</tool_call>'
                            '<tool_call>not json</tool_call>'
                            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'))
    assert out[0].text == "Error: unknown tool 'nope' (tools: boom, broken, calculator)"
    assert out[1].text == "Error: boom raised RuntimeError: exploded on 3" and out[1].failure is None
    assert out[2].text.startswith("Error: the tool call is not valid JSON")
    assert out[3].text.startswith("Error: at most 3 tool calls per turn")  # the fourth call is not run
    assert all(o.error for o in out)
    failed = runner.run(_calls('<tool_call>{"name": "broken", "arguments": {}}</tool_call>'))[0]
    assert failed.failure == "tool broken: backend unreachable"  # the tool, not the call: the trajectory fails


def test_hung_and_flooding_tools_cannot_stall_or_flood_the_step():
    runner = ToolRunner([Sleeper(), Printer(), Calculator()], timeout=0.5, max_chars=100, workers=2)
    start = time.monotonic()
    out = runner.run(_calls('<tool_call>{"name": "sleep", "arguments": {}}</tool_call>'
                            '<tool_call>{"name": "spam", "arguments": {}}</tool_call>'))
    assert time.monotonic() - start < 3
    assert out[0].timeout and out[0].text == "Error: sleep timed out after 0.5 s"
    assert len(out[1].text) < 200 and "characters cut" in out[1].text
    # the hung threads gave their worker slots back: calls still run
    for _ in range(3):
        runner.run(_calls('<tool_call>{"name": "sleep", "arguments": {}}</tool_call>'))
    ok = runner.run(_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'))
    assert ok[0].text == "42"
    fails = ToolRunner([Sleeper()], timeout=0.2, timeout_is_failure=True).run(
        _calls('<tool_call>{"name": "sleep", "arguments": {}}</tool_call>'))
    assert fails[0].failure == "tool sleep timed out after 0.2 s"


def test_truncation_sides():
    text = "a" * 50 + "b" * 50
    assert truncate(text, 200) == text
    assert truncate(text, 10, "left") == "a" * 10 + "...[90 characters cut]..."
    assert truncate(text, 10, "right") == "...[90 characters cut]..." + "b" * 10
    assert truncate(text, 10, "middle") == "a" * 5 + "...[90 characters cut]..." + "b" * 5


def test_sandbox_runs_code_within_its_limits():
    assert run_python("print(sum(range(10)))").text == "45\n"
    assert run_python("import math, json, re, fractions\nprint(json.dumps([math.factorial(5)]))").text == "[120]\n"
    out = run_python("open('note.txt', 'w').write('hi')\nprint(open('note.txt').read())")
    assert out.text == "hi\n" and not out.error
    err = run_python("def f():\n    return 1 / 0\nf()")
    assert err.error and "ZeroDivisionError" in err.text and "<tool>" in err.text
    start = time.monotonic()
    slow = run_python("while True:\n    pass", wall_seconds=1.0, cpu_seconds=5)
    assert slow.timeout and time.monotonic() - start < 5
    spin = run_python("while True:\n    pass", wall_seconds=30, cpu_seconds=1)
    assert spin.error and "CPU time limit" in spin.text
    flood = run_python("while True:\n    print('x' * 1000)", max_output_bytes=10_000)
    assert flood.error and "more than 10000 bytes" in flood.text and len(flood.text) < 11_000
    big = run_python("x = bytearray(4 << 30)", memory_mb=256)
    assert big.error and "MemoryError" in big.text


def test_sandbox_escape_attempts_are_refused(tmp_path):
    secret = tmp_path / "run" / "checkpoint.txt"
    secret.parent.mkdir()
    secret.write_text("SECRET")
    attempts = {
        "read the run directory": f"print(open({str(secret)!r}).read())",
        "list it": f"import os\nprint(os.listdir({str(secret.parent)!r}))",
        "write into it": f"open({str(secret.parent / 'pwn')!r}, 'w').write('x')",
        "delete from it": f"import os\nos.remove({str(secret)!r})",
        "low-level open": f"import os\nprint(os.read(os.open({str(secret)!r}, os.O_RDONLY), 9))",
        "a socket": "import socket\nsocket.create_connection(('127.0.0.1', 9))",
        "the C socket module": "import _socket\n_socket.socket()",
        "a subprocess": "import subprocess\nsubprocess.run(['ls'])",
        "os.system": f"import os\nos.system('touch {secret.parent / 'pwn2'}')",
        "fork": "import os\nos.fork()",
        "ctypes": "import ctypes",
        "the environment": "import os\nprint(os.environ['HOME'])",
        "/etc/passwd": "print(open('/etc/passwd').read())",
    }
    for what, code in attempts.items():
        out = run_python(code)
        assert out.error, what
        assert "SECRET" not in out.text and "root:" not in out.text, what
    assert sorted(os.listdir(secret.parent)) == ["checkpoint.txt"] and secret.read_text() == "SECRET"
    tool = PythonTool()
    assert tool.name == "python" and tool.execute({"code": "print(6*7)"}) == run_python("print(6*7)")


@pytest.mark.skipif(not network_namespace_prefix(), reason="no unprivileged user namespaces here")
def test_sandbox_has_no_network_even_past_the_audit_hook():
    # The kernel-level guard: inside the namespace there is no interface, whatever the code imports.
    out = run_python("print(open('/proc/net/dev').read())")
    assert out.error  # /proc is outside the sandbox for the hook as well
    import subprocess
    import sys

    probe = subprocess.run(list(network_namespace_prefix()) + [sys.executable, "-c",
                           "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)"],
                           capture_output=True, text=True, timeout=30)
    assert probe.returncode != 0 and "unreachable" in probe.stderr.lower()
