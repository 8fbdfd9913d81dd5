"""The ``code_tests`` reward's judge: a completion's program against a row's tests, so that the program can
answer for its own functions and nothing else.

Two sandboxes (``sandbox.confine``) run side by side, each in its own namespaces, and never share anything:

- the **program's**: it runs the completion's code, then serves requests for the names it defined: a name's
  value, a call, an attribute, an item. It answers with plain data (exact builtin types: ``None``, ``bool``,
  ``int``, ``float``, ``str``, lists, tuples, sets, dicts of them) or, for anything else (a function, an
  instance), a handle the other side may call or look into;
- the **tests'**: it runs each test whole (setup statements, loops, comprehensions, ``assert`` anywhere) with
  the real builtins, and every name the test uses that is not a builtin's name is asked of the program's side
  and stands there as its plain value or a proxy that forwards calls. Arguments travel as plain data, and a
  list, dict or set a call changed in place comes back changed. Each test's verdict (it ran to its end) is
  decided here, where no model-written code ever runs.

The parent only relays lines between the two (bounded in length and in number, parsed without recursion
limits to hit: a line it cannot read is dropped) and reads the verdicts from the tests' side. So a program
that shadows ``abs`` or ``sorted``, rewrites the builtins module, patches a type through ``gc``, prints forged
answer lines, finds a nonce or exits early changes only the values of its own functions, which it chooses
anyway; a value that is not plain data cannot be compared, tested for truth or iterated (the test fails).
What a test may rely on: names it does not define are the program's, except the builtins' names (a program's
``max`` is not the test's); the program's exceptions arrive as the builtin exception of the same name (else
``Exception``); its objects' methods and attributes are reached through handles, their dunder methods are
not (``==`` on an instance is identity). The whole judgement has the reward's wall time.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from contextlib import ExitStack
from typing import Any

from posttrain.sandbox.confine import Launched, Limits, launched

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
#: the longest line either side may send (longer ones are dropped), and lines relayed per judgement
LINE_BYTES, LINES = 1 << 20, 100_000


def last_code_block(text: str) -> str | None:
    """The last fenced code block (```python ... ```) of a completion."""
    found = _BLOCK.findall(text)
    return found[-1] if found else None


#: plain data back from its JSON form, on both sides (``handles``: the program's objects a request names)
DECODE = r"""
def _value(data, handles=()):
    kind, item = data
    if kind == "handle":
        return handles[item]
    if kind == "float":
        return float(item)
    if kind in ("int", "str", "bool", "NoneType"):
        if type(item) is not {"int": int, "str": str, "bool": bool, "NoneType": type(None)}[kind]:
            raise TypeError("not " + kind)
        return item
    if kind == "dict":
        return {_value(k, handles): _value(v, handles) for k, v in item}
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](_value(v, handles) for v in item)
"""

#: the program's side: reads its code, runs it, then answers requests, one JSON line each way
PROGRAM = (
    r"""
import json as _json, os as _os, sys as _sys
_loads, _dumps, _write, _type, _repr, _sorted = _json.loads, _json.dumps, _os.write, type, repr, sorted
_readline = _sys.stdin.buffer.readline
_PLAIN = (int, float, str, bool, type(None))
_handles = []


def _plain(value, budget):
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError("value too large")
    kind = _type(value)
    if kind in _PLAIN:
        return [kind.__name__, _repr(value) if kind is float else value]
    if kind in (list, tuple, set, frozenset):
        items = [_plain(v, budget) for v in value]
        return [kind.__name__, _sorted(items, key=_dumps) if kind in (set, frozenset) else items]
    if kind is dict:
        return ["dict", [[_plain(k, budget), _plain(v, budget)] for k, v in value.items()]]
    raise TypeError("not plain")


def _answer(value):
    try:
        return ["value", _plain(value, [100000])]
    except (TypeError, ValueError, RecursionError):
        _handles.append(value)
        return ["handle", len(_handles) - 1]


"""
    + DECODE
    + r"""
_job = _loads(_readline())
_names = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(_job["code"], "solution.py", "exec"), _names)
except BaseException:
    pass
while True:
    _line = _readline()
    if not _line:
        break
    try:
        _number, _op, *_fields = _loads(_line)
        if _op == "get":
            _reply = _answer(_names[_fields[0]]) if _fields[0] in _names else ["missing"]
        elif _op == "call":
            _args = [_value(a, _handles) for a in _fields[1]]
            _result = _handles[_fields[0]](*_args, **{k: _value(v, _handles) for k, v in _fields[2].items()})
            _changed = [[i, _plain(a, [100000])] for i, a in enumerate(_args) if _type(a) in (list, dict, set)]
            _reply = _answer(_result) + [_changed]
        elif _op == "attr":
            _reply = _answer(getattr(_handles[_fields[0]], _fields[1]))
        else:
            _reply = _answer(_handles[_fields[0]][_value(_fields[1], _handles)])
    except BaseException as _error:
        _reply = ["error", _type(_error).__name__]
    _write(1, ("\nA " + _dumps([_number, *_reply]) + "\n").encode())  # on a line of its own
"""
)

#: the tests' side: runs each test with the real builtins, the program's names asked of the other side
TESTS = (
    r"""
import ast, builtins, io, json, os, sys
_in, _out = sys.stdin.buffer.readline, os.write
job = json.loads(_in())
sys.stdout = sys.stderr = io.StringIO()  # what the tests print goes nowhere
BUILTIN = set(dir(builtins))
asked = [0]


class ProgramError(Exception):
    pass


def ask(op, *fields):
    asked[0] += 1
    _out(1, ("Q " + json.dumps([asked[0], op, *fields]) + "\n").encode())
    while True:
        line = _in()
        if not line:
            raise EOFError("the program's side ended")
        try:
            got = json.loads(line)
        except ValueError:
            continue
        if isinstance(got, list) and len(got) >= 2 and got[0] == asked[0]:
            return got[1:]


def plain(value):
    if isinstance(value, Remote):
        return ["handle", object.__getattribute__(value, "handle")]
    kind = type(value)
    if kind in (int, str, bool, type(None)):
        return [kind.__name__, value]
    if kind is float:
        return ["float", repr(value)]
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [plain(v) for v in value]]
    if kind is dict:
        return ["dict", [[plain(k), plain(v)] for k, v in value.items()]]
    raise TypeError("only plain data is passed to the program")


"""
    + DECODE
    + r"""
def result(got, args=()):
    if got[0] == "error":
        kind = getattr(builtins, str(got[1]), None)
        raise kind() if isinstance(kind, type) and issubclass(kind, Exception) else ProgramError(got[1])
    if got[0] == "missing":
        raise NameError("the program does not define it")
    found = Remote(got[1]) if got[0] == "handle" else _value(got[1])
    for index, changed in (got[2] if len(got) > 2 else []):
        target, new = args[index], _value(changed)
        if isinstance(target, list) and isinstance(new, list):
            target[:] = new
        elif isinstance(target, (dict, set)) and type(new) is type(target):
            target.clear()
            target.update(new)
    return found


class Remote:
    __slots__ = ("handle",)

    def __init__(self, handle):
        object.__setattr__(self, "handle", handle)

    def __call__(self, *args, **kwargs):
        handle = object.__getattribute__(self, "handle")
        got = ask("call", handle, [plain(a) for a in args], {k: plain(v) for k, v in kwargs.items()})
        return result(got, args)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return result(ask("attr", object.__getattribute__(self, "handle"), name))

    def __getitem__(self, key):
        return result(ask("item", object.__getattribute__(self, "handle"), plain(key)))

    def __bool__(self):
        raise TypeError("a program's object is not plain data")

    def __iter__(self):
        raise TypeError("a program's object is not plain data")

    def __len__(self):
        raise TypeError("a program's object is not plain data")


for index, test in enumerate(job["tests"]):
    passed = False
    try:
        tree = compile(test, "test", "exec", ast.PyCF_ONLY_AST)
        scope = {"__name__": "__test__", "__builtins__": builtins}
        wanted = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - BUILTIN
        for name in sorted(wanted):
            got = ask("get", name)
            if got[0] != "missing":
                scope[name] = result(got)
        exec(compile(tree, "test", "exec"), scope)
        passed = True
    except BaseException:
        pass
    _out(1, ("R " + json.dumps([index, passed]) + "\n").encode())
"""
)


def _lines(stream: Any, limit: int = LINE_BYTES) -> Any:
    """The complete lines of ``stream`` no longer than ``limit`` (a longer one is read through and dropped)."""
    long = False
    while line := stream.readline(limit):
        if not line.endswith(b"\n"):
            long = True
            continue
        if long:
            long = False
            continue
        yield line


def _send(stream: Any, data: bytes) -> bool:
    """``data`` written to a sandbox's stdin; False when it is closed (the sandbox ended)."""
    try:
        stream.write(data)
        stream.flush()
        return True
    except (OSError, ValueError):
        return False


def _relay(program: Launched, tests: Launched, verdicts: dict[int, bool], count: int) -> None:
    """Requests from the tests' side to the program's, answers back (each a bounded line), verdicts kept."""

    def answers() -> None:
        sent = 0
        for line in _lines(program.process.stdout):
            if line.startswith(b"A ") and sent < LINES:
                sent += 1
                if not _send(tests.process.stdin, line[2:]):
                    return
        with contextlib.suppress(OSError, ValueError):  # the program ended: what it did not answer fails now
            tests.process.stdin.close()

    relay = threading.Thread(target=answers, daemon=True)
    relay.start()
    asked = 0
    for line in _lines(tests.process.stdout):
        if line.startswith(b"Q ") and asked < LINES:
            asked += 1
            _send(program.process.stdin, line[2:])
        elif line.startswith(b"R "):
            try:
                index, passed = json.loads(line[2:])
            except (ValueError, TypeError, RecursionError):
                continue
            if type(index) is int and type(passed) is bool and 0 <= index < count:
                verdicts[index] = passed
            if len(verdicts) == count:
                return


def tests_passed(
    code: str | None,
    tests: list[str],
    limits: Limits,
    strict: bool = True,
    cancel: threading.Event | None = None,
) -> float:
    """The share of ``tests`` the code passes (0 without code, or when nothing comes back in time;
    ``cancel`` set: the sandboxes end at once, what came back counts)."""
    if not code or not tests:
        return 0.0
    verdicts: dict[int, bool] = {}
    deadline = time.monotonic() + limits.wall
    with ExitStack() as stack:
        program = stack.enter_context(launched(PROGRAM, limits, strict))
        judge = stack.enter_context(launched(TESTS, limits, strict))
        for side, job in ((program, {"code": code}), (judge, {"tests": list(tests)})):
            if not _send(side.process.stdin, json.dumps(job).encode() + b"\n"):
                return 0.0
        relay = threading.Thread(target=_relay, args=(program, judge, verdicts, len(tests)), daemon=True)
        relay.start()
        while relay.is_alive() and time.monotonic() < deadline and not (cancel and cancel.is_set()):
            relay.join(timeout=0.05)
        # leaving the block ends both sandboxes (their pipes close, the relay ends)
    return sum(verdicts.get(i, False) for i in range(len(tests))) / len(tests)
