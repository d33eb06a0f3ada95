"""The fast tier's guard (process_guard.py): a test that launches a process without the
``multiprocess`` marker fails collection, through a helper or a fixture too, and one that launches
behind an indirection the source does not show fails when it launches. Runs pytest in this process
(pytester) on small test files."""

import pytest

CONFTEST = """
import pytest

pytest_plugins = ["process_guard"]
"""
INI = """
[pytest]
markers =
    multiprocess: launches real worker processes
"""


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    return pytester


def test_an_unmarked_launch_fails_collection_naming_test_and_call(suite):
    suite.makepyfile(
        test_leak="""
        import subprocess
        import sys

        def test_leaks():
            subprocess.run([sys.executable, "-c", "pass"])

        def test_in_process():
            assert 1 + 1 == 2
        """
    )
    result = suite.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*without @pytest.mark.multiprocess*", "*test_leak.py::test_leaks: the test calls subprocess.run*"]
    )
    assert "test_in_process" not in result.stderr.str()


def test_a_marked_launch_is_collected(suite):
    suite.makepyfile(
        test_marked="""
        import subprocess
        import sys

        import pytest

        pytestmark = pytest.mark.multiprocess

        def test_launches():
            subprocess.run([sys.executable, "-c", "pass"])
        """
    )
    result = suite.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*test_marked.py::test_launches*", "1 test collected*"])


def test_launches_through_helpers_and_fixtures_are_found(suite):
    suite.makepyfile(
        test_hidden="""
        import multiprocessing as mp
        import os

        import pytest

        def _start(target):
            mp.Process(target=target).start()

        def _helper():
            _start(print)

        @pytest.fixture(scope="module")
        def forked():
            return os.fork()

        @pytest.fixture
        def uses_forked(forked):
            return forked

        def test_through_helpers():
            _helper()

        def test_through_fixtures(uses_forked):
            pass

        def test_suite_runner():
            from shardcore_conformance import run_suite

            run_suite([], "fsdp2")
        """
    )
    result = suite.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*3 test(s) launch processes*",
            "*::test_through_helpers: the test calls _helper -> _start -> mp.Process*",
            "*::test_through_fixtures: fixture forked calls os.fork*",
            "*::test_suite_runner: the test calls run_suite*",
        ]
    )


def test_a_launch_the_source_does_not_show_fails_at_run_time(suite):
    suite.makepyfile(
        test_indirect="""
        import importlib
        import sys

        def test_indirect():
            launch = getattr(importlib.import_module("subpro" + "cess"), "ru" + "n")
            launch([sys.executable, "-c", "pass"])

        def test_os_level():
            getattr(importlib.import_module("o" + "s"), "fo" + "rk")()
        """
    )
    result = suite.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_indirect started a process (subprocess.Popen*) without @pytest.mark.multiprocess*",
            "*test_os_level started a process (os.fork) without @pytest.mark.multiprocess*",
        ]
    )
