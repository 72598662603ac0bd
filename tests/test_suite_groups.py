"""How `make test` spreads the suite over the cores (tests/conftest.py): under
`-n 3 --dist loadgroup`, the tests that start Ray run in two groups, each on one worker (the
whole-loop tests, marked deepspeed too, and the rest), and each module's other tests run
together, their module fixtures built once. Run on a copy of the conftest, in a
subprocess, so a pytest or pytest-xdist release that stops honouring the groups fails here."""

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.pure

CONFTEST = Path(__file__).with_name("conftest.py")

MODULE = """
import json, os
import pytest
{mark}

@pytest.fixture(scope="module")
def built(request):
    with open({log!r}, "a") as f:
        f.write(json.dumps(["setup", request.module.__name__, os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")
    return 1

{tests}
"""


def _module(pytester, name, log, marks):
    tests = "\n".join(f"def test_{i}(built):\n    with open({str(log)!r}, 'a') as f:\n"
                      "        f.write(json.dumps(['test', __name__, os.environ.get('PYTEST_XDIST_WORKER')]) + '\\n')\n"
                      for i in range(4))
    mark = f"pytestmark = [{', '.join(f'pytest.mark.{m}' for m in marks)}]"
    pytester.makepyfile(**{name: MODULE.format(mark=mark, log=str(log), tests=tests)})


def test_each_ray_group_shares_one_worker_and_modules_build_their_fixtures_once(pytester, tmp_path):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    ray: starts a local Ray cluster\n    deepspeed: DeepSpeed\n")
    log = tmp_path / "log.jsonl"
    modules = {"test_ray_a": ("ray",), "test_ray_b": ("ray",), "test_loop_c": ("ray", "deepspeed"),
               "test_loop_d": ("ray", "deepspeed"), "test_plain_e": (), "test_plain_f": ()}
    for name, marks in modules.items():
        _module(pytester, name, log, marks)
    result = pytester.runpytest_subprocess("-n", "3", "--dist", "loadgroup", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4 * len(modules))
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    setups = [r[1] for r in rows if r[0] == "setup"]
    assert sorted(setups) == sorted(modules), setups  # each module's fixture once
    tests = [r for r in rows if r[0] == "test"]

    def workers(prefix):
        return {r[2] for r in tests if r[1].startswith(prefix)}

    assert len(workers("test_ray")) == 1 and len(workers("test_loop")) == 1, tests
    for module in ("test_plain_e", "test_plain_f"):
        assert len(workers(module)) == 1, tests
