"""tests/scheduling.py: the tests of one module fixture form one xdist work unit, longest first."""

import scheduling

SOURCE = """
import pytest

@pytest.fixture(scope="module")
def shared():
    return 1

def test_a(shared):
    pass

def test_free():
    pass

def test_b(shared):
    pass
"""


def _items(pytester, loadgroup):
    pytester.makepyfile(test_m=SOURCE)
    items, _ = pytester.inline_genitems()
    items[0].config.option.loadgroup = loadgroup
    scheduling.pytest_collection_modifyitems(items[0].config, items)
    return items


def test_a_module_fixtures_tests_are_one_xdist_unit(pytester):
    """Under --dist loadgroup the group is the node id's suffix, which xdist's scheduler reads (xdist
    3.8's own suffix is lost on pytest 9), and the group's tests stay next to each other."""
    items = _items(pytester, True)
    ids = [i.nodeid for i in items]
    assert ids[0] == "test_m.py::test_a@test_m.py::shared" and ids[1] == "test_m.py::test_b@test_m.py::shared", ids
    assert ids[2] == "test_m.py::test_free", ids
    assert all(m.args == ("test_m.py::shared",) for i in items[:2] for m in i.iter_markers("xdist_group"))


def test_a_serial_run_keeps_plain_node_ids(pytester):
    ids = [i.nodeid for i in _items(pytester, False)]
    assert ids == ["test_m.py::test_a", "test_m.py::test_b", "test_m.py::test_free"], ids
