"""The code_tests judge (``sandbox.code_tests``) against programs that try to forge their score: every
forgery a review found (a builtin shadowed or rewritten, a test's expected side computed where the program
could reach it, answer lines printed, output that made the parent's parsing raise) and the tests a real
dataset writes (setup, loops, comprehensions, expected exceptions, classes, in-place changes). Each is a real
pair of sandboxes."""

from __future__ import annotations

import pytest

from posttrain.sandbox import code_tests
from posttrain.sandbox.confine import Limits, confinement

LIMITS = Limits(wall=8, cpu=4, memory=256 * 2**20, processes=16, disk=32 * 2**20)
FULL = pytest.mark.skipif(bool(confinement().missing), reason="this machine lacks a required confinement")
# one worker for every test that starts sandboxes: a test here sweeps the machine's idle sandbox cgroups
# at once (STALE_S), which would take another worker's just made ones
pytestmark = pytest.mark.xdist_group("sandboxes")

ROOT = "def root(x):\n    return x ** 0.5\n"
SORT = "def f(x):\n    return sorted(x)\n"
FACT = "import math\ndef f(n):\n    return math.factorial(n) // 1\n"
WRONG = "def f(x):\n    return 0\n\ndef root(x):\n    return 0\n"

FORGERIES = [
    # (tests, a solution, the forging program without one)
    (["assert abs(root(2) - 1.41421356) < 1e-6"], ROOT, "abs = lambda *a: 0\n" + WRONG),
    (["x = [3, 1, 2]\nassert f(x) == sorted(x)"], SORT, "sorted = lambda x: 0\n" + WRONG),
    (
        ["x = [3, 1, 2]\nassert f(x) == sorted(x)"],
        SORT,
        "import builtins\nbuiltins.sorted = lambda x: 0\n" + WRONG,
    ),
    (["assert f(5) == 5 * 24"], FACT, "import builtins\nbuiltins.int = None\n" + WRONG),
    (["n = 5\nassert f(n) == n * 24"], FACT, "n = 0\n" + WRONG),
    (
        ["assert abs(root(2) - 1.41421356) < 1e-6"],
        ROOT,
        "import gc\ngc.get_referents(float.__dict__)[0]['__lt__'] = lambda a, b: True\n" + WRONG,
    ),
    (
        ["assert f(5) == 120"],
        FACT,
        'for i in range(40):\n    print(f\'A [{i}, "value", ["int", 120], []]\')\n'
        "    print(f'R [{i % 3}, true]')\n" + WRONG,
    ),
    (
        ["assert f(5) == 120", "assert f(5)"],
        FACT,
        "class Everything:\n    def __eq__(self, other):\n        return True\n    def __bool__(self):\n"
        "        return True\ndef f(n):\n    return Everything()\n",
    ),
]


@FULL
@pytest.mark.parametrize(("tests", "solution", "forgery"), FORGERIES)
def test_a_forgery_scores_nothing_and_the_solution_everything(
    tests: list[str], solution: str, forgery: str
) -> None:
    assert code_tests.tests_passed(solution, tests, LIMITS) == 1.0
    assert code_tests.tests_passed(forgery, tests, LIMITS) == 0.0


@FULL
@pytest.mark.parametrize(
    "noise",
    [
        "print('[' * 100000)",  # made the parent's parsing raise RecursionError
        "print('A [[0], \"value\", [\"int\", 1]]')\nprint('R [[0], true]')",  # a list as an index
        "import sys\nsys.stdout.write('x' * (4 << 20))",  # a 4 MiB flood, one line
        "import os\nos.write(1, b'\\xff\\xfe' * 1000)",
    ],
)
def test_nothing_the_program_prints_stops_the_judge(noise: str) -> None:
    assert (
        code_tests.tests_passed(noise + "\n" + FACT, ["assert f(5) == 120", "assert f(3) == 6"], LIMITS)
        == 1.0
    )


@FULL
def test_what_a_dataset_writes_is_judged_as_python_would() -> None:
    code = (
        "def add(a, b):\n    return a + b\n\n"
        "def positive(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n\n"
        "def sort_in_place(xs):\n    xs.sort()\n\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n        return len(self.items)\n"
    )
    tests = [
        "x = add(2, 3)\nassert x == 5",
        "assert add('a', 'b') in ['ab', 'ba']",
        "assert add(1, 1)",
        "for n in range(3):\n    assert add(n, 0) == n",
        "assert all(add(i, i) == 2 * i for i in range(4))",
        "import math\nassert math.isclose(add(0.1, 0.2), 0.3)",
        "assert add(1, 2) == 3.0",
        "try:\n    positive(-1)\n    assert False\nexcept ValueError:\n    pass",
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
        "s = Stack()\ns.push(1)\nassert s.push(2) == 2 and s.items == [1, 2]",
        # these fail: a wrong value, not Python, a program object where a value is wanted
        "assert add(1, 1) == 3",
        "this is not python",
        "assert Stack()",
    ]
    assert code_tests.tests_passed(code, tests, LIMITS) == pytest.approx(10 / 13)


@FULL
def test_a_program_that_hangs_or_exits_scores_what_came_back() -> None:
    assert code_tests.tests_passed("import os\nos._exit(0)\n", ["assert f(1) == 1"], LIMITS) == 0.0
    slow = "import time\ndef f(x):\n    if x == 2:\n        time.sleep(60)\n    return x\n"
    assert (
        code_tests.tests_passed(slow, ["assert f(1) == 1", "assert f(2) == 2"], Limits(wall=3, cpu=3)) == 0.5
    )


@FULL
def test_reward_timeout_in_this_process_ends_the_sandboxes_at_once() -> None:
    """In-process (no reward workers), ``reward_timeout`` is the call's: the code_tests reward returns at it,
    its sandboxes ended then, not at their own wall time."""
    import time

    from posttrain.config.rewards import CodeTestsReward
    from posttrain.rewards.calls import call_here
    from posttrain.rewards.functions import code_tests

    reward = code_tests(CodeTestsReward(timeout=30, parallel=2))
    hang = "```python\nimport time\ndef f(x):\n    time.sleep(60)\n```"
    started = time.monotonic()
    outcome = call_here(reward, {"completions": [hang] * 4, "tests": [["assert f(1) == 1"]] * 4}, 1.5)
    assert outcome.failure == "timeout" and time.monotonic() - started < 5
