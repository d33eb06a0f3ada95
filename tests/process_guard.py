"""A pytest plugin (loaded by conftest.py): a test that starts a process must carry the
``multiprocess`` marker, so that ``-m 'not multiprocess'`` (``make test-fast``) never starts one.

Two checks, because either alone can be fooled:

* at collection, a static one: the source of each unmarked test, of the fixtures it requests that
  are defined in the tests, and of the test-suite functions they call (in their own module or in a
  helper module under ``tests/``), transitively, must call nothing that launches a process; one
  that does fails collection, naming the test and the call;
* at run time, a backstop for what the source does not show (a launch behind an indirection):
  while an unmarked test sets up, runs and tears down, starting a process fails it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import multiprocessing.process
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from shardcore_conformance.zygote import Zygote

MARKER = "multiprocess"
TESTS = Path(__file__).resolve().parent

#: calls that launch a process, by their dotted name as written
LAUNCHERS = {
    "harness.run",
    "harness.python",
    "harness.torchrun",
    "harness.ranks",
    "harness.start_ranks",
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.popen",
    "os.posix_spawn",
    "os.posix_spawnp",
    "mp.spawn",
    "mp.start_processes",
    "xmp.spawn",
}
#: a call with this last part launches whatever module it comes from
LAUNCHER_NAMES = {"run_suite", "run_cases", "Popen", "start_processes"}
#: every call into these modules launches (their exceptions and constants are not calls)
LAUNCHER_MODULES = (
    "subprocess.",
    "multiprocessing.",
    "torch.multiprocessing.",
    "torch_xla.distributed.xla_multiprocessing.",
)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _launcher(name: str, namespace: dict) -> bool:
    """Whether a call of ``name`` launches, as written or with an aliased module spelled out
    (``mp.Process`` after ``import multiprocessing as mp``)."""
    head, _, rest = name.partition(".")
    module = namespace.get(head)
    names = {name} | ({f"{module.__name__}.{rest}"} if isinstance(module, types.ModuleType) and rest else set())
    return any(
        n in LAUNCHERS or n.rsplit(".", 1)[-1] in LAUNCHER_NAMES or n.startswith(LAUNCHER_MODULES) for n in names
    )


def _in_suite(obj, roots: tuple[Path, ...]) -> bool:
    try:
        path = Path(inspect.getsourcefile(obj)).resolve()
    except (TypeError, OSError):
        return False
    return any(path.is_relative_to(root) for root in roots)


def _resolve(name: str, namespace: dict, roots: tuple[Path, ...]):
    """What ``name`` (``f`` or ``module.f``) means in ``namespace``, if it is a function of the test
    suite (the only code followed: library code is what the tests exercise, not how they launch)."""
    head, *rest = name.split(".")
    obj = namespace.get(head)
    for part in rest:
        if not isinstance(obj, types.ModuleType):
            return None
        obj = getattr(obj, part, None)
    obj = inspect.unwrap(obj) if callable(obj) else obj
    return obj if isinstance(obj, types.FunctionType) and _in_suite(obj, roots) else None


@functools.lru_cache(maxsize=None)
def launches(fn: types.FunctionType, roots: tuple[Path, ...]) -> tuple[str, ...]:
    """The launching calls in ``fn``'s source and in the test-suite functions (under ``roots``) it
    calls, each as ``"call"`` or ``"helper -> ... -> call"``."""
    return tuple(_launches(fn, roots, frozenset()))


def _launches(fn: types.FunctionType, roots: tuple[Path, ...], seen: frozenset) -> list[str]:
    if fn in seen:
        return []
    seen = seen | {fn}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        if _launcher(name, fn.__globals__):
            found.append(name)
        elif (helper := _resolve(name, fn.__globals__, roots)) is not None:
            found += [f"{name} -> {via}" for via in _launches(helper, roots, seen)]
    return found


def _fixture_functions(item, roots: tuple[Path, ...]) -> list[types.FunctionType]:
    """The test-suite functions of every fixture ``item`` uses (the closure: fixtures of fixtures)."""
    info = getattr(item, "_fixtureinfo", None)
    out = []
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ())[-1:]:
            fn = inspect.unwrap(fixturedef.func)
            if isinstance(fn, types.FunctionType) and _in_suite(fn, roots):
                out.append(fn)
    return out


def undeclared_launches(item) -> list[str]:
    """What an unmarked test (or a fixture it uses) calls that launches a process; [] when marked."""
    if item.get_closest_marker(MARKER) is not None or not isinstance(item, pytest.Function):
        return []
    # the suite's code: tests/ and the test file's own folder (a pytester run's files live elsewhere)
    roots = tuple(dict.fromkeys((TESTS, Path(str(item.path)).resolve().parent)))
    found = [f"the test calls {call}" for call in launches(item.function, roots)]
    for fn in _fixture_functions(item, roots):
        found += [f"fixture {fn.__name__} calls {call}" for call in launches(fn, roots)]
    return found


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    bad = {item.nodeid: calls for item in items if (calls := undeclared_launches(item))}
    if bad:
        lines = [f"  {nodeid}: {'; '.join(dict.fromkeys(calls))}" for nodeid, calls in bad.items()]
        raise pytest.UsageError(
            f"{len(bad)} test(s) launch processes without @pytest.mark.{MARKER}, so they would run in the "
            f"fast tier (-m 'not {MARKER}', make test-fast). Mark them:\n" + "\n".join(lines)
        )


# ------------------------------------------------------------------------ the run-time backstop


#: where in-process library code runs a probe, not a worker: ctypes.util.find_library runs
#: ``ldconfig -p`` (or gcc) to find a shared library, which torch and others do on first use
_PROBES = (f"ctypes{os.sep}util.py",)


def _from_probe() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_PROBES):
            return True
        frame = frame.f_back
    return False


def _refuse(nodeid: str, what: str, original):
    # wraps: the stand-in keeps the original's module and name, so that pickle still writes a
    # reference to it (test_safe_loading.py pickles payloads naming os.system)
    @functools.wraps(original)
    def refused(*args, **kwargs):
        if what == "subprocess.Popen" and _from_probe():
            return original(*args, **kwargs)
        detail = f" {args[1]!r}" if what == "subprocess.Popen" and len(args) > 1 else ""
        pytest.fail(
            f"{nodeid} started a process ({what}{detail}) without @pytest.mark.{MARKER}: mark it, or the fast "
            f"tier (-m 'not {MARKER}', make test-fast) starts processes",
            pytrace=False,
        )

    return refused


#: (owner, attribute, name in messages): every way a process starts goes through one of these;
#: os's functions are posix's, reachable (and pickled) by both names
_ENTRY_POINTS = (
    (subprocess.Popen, "_execute_child", "subprocess.Popen"),
    (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start"),
    (Zygote, "start", "a zygote's fork (Zygote.start)"),
    *(
        (module, name, f"os.{name}")
        for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp")
        for module in (os, sys.modules.get("posix"))
        if module is not None
    ),
)


def _guarded(item):
    """Start-a-process entry points refused while an unmarked ``item`` runs a phase."""
    if item.get_closest_marker(MARKER) is not None:
        return (yield)
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in _ENTRY_POINTS if attr in owner.__dict__]
    stand_ins = {}  # one per original, so that os.system is posix.system still
    for owner, attr, what in _ENTRY_POINTS:
        if attr in owner.__dict__:
            original = owner.__dict__[attr]
            if id(original) not in stand_ins:
                stand_ins[id(original)] = _refuse(item.nodeid, what, original)
            setattr(owner, attr, stand_ins[id(original)])
    try:
        return (yield)
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


# Setup and teardown too: a module-scoped fixture that launches runs in the setup of its first test.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guarded(item))
