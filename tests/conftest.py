"""Shared fixtures for the test suite, and the rule on skips in CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from pdd.lab.launch import PORTS_ENV, port_range

CI_MAY_SKIP = "ci_may_skip"


def in_ci() -> bool:
    """`CI` set to anything but empty, 0, false or no (CI services set CI=true)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


# ---- no silent skips in CI -------------------------------------------------------------
# A test skips when something it needs is missing: a test extra (`pytest.importorskip`),
# a data file. On a developer's machine that is a notice; in CI it is a broken install,
# so there every skip is a failure, whether it happens at collection (a module-level
# importorskip) or in a test. A test that may rightly skip on CI's hardware (one that
# needs a GPU, say) says so with @pytest.mark.ci_may_skip; an xfail is not a skip.

# ---- the vLLM backend's tests run unless left out ------------------------------------------
# tests/test_vllm_*.py are collected by default (scripts/test.sh, which CI runs, installs the
# vllm extra); `PDD_VLLM=0` leaves them out, for a quick local run, and the run's summary says
# so. Asked for and vLLM missing, they fail, CI or not: a run that meant to test the vLLM
# backend and skipped it would pass without having tested it.

_VLLM_LEFT_OUT = pytest.StashKey[set]()  # the vLLM modules left out of this run


def _vllm_tests_wanted() -> bool:
    return os.environ.get("PDD_VLLM", "1") != "0"


def _is_vllm_test(path: Path) -> bool:
    return path.name.startswith("test_vllm_")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if _is_vllm_test(collection_path) and not _vllm_tests_wanted():
        config.stash.setdefault(_VLLM_LEFT_OUT, set()).add(collection_path.name)
        return True
    return None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    left_out = config.stash.get(_VLLM_LEFT_OUT, set())
    if left_out:
        terminalreporter.write_line(f"vLLM backend tests not run ({len(left_out)} modules): PDD_VLLM=0 "
                                    "leaves them out; scripts/test.sh without it installs vLLM and runs them")


# ---- a vLLM test's timeout covers its fixtures' start-up -------------------------------------
# pytest-timeout counts a test's setup in its time: the first test of a vLLM module starts its
# deployment and the session's plain vLLM there, each of which may take `procs.VLLM_START_S`
# (300 s) on two busy cores; so every vLLM test gets both on top of the suite's own timeout.
# (A number here, not an import of procs: this file also runs alone, on scratch suites.)
VLLM_SETUP_S = 2 * 300.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suite = float(config.getini("timeout") or 0)
    for item in items:
        if _is_vllm_test(Path(str(item.fspath))) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(suite + VLLM_SETUP_S))
    items.sort(key=lambda item: _turn(Path(str(item.fspath))))


# ---- on two workers, vLLM's modules on one and the longest of the rest first ----------------
# The suite runs on pytest-xdist workers a module at a time (`--dist loadfile`: a module's
# deployments are its own). The vLLM modules go to one worker as one unit, first: the session's
# plain vLLM (`vllm_reference`) then starts once, and their CPU-bound starts (vLLM's engines, its
# compiles) run beside the other worker's modules, which mostly wait on timers and lines. The
# other modules follow, the longest first (measured at cf9c8b0: BENCHMARKS.md, "The suite's
# time"), so the last ones to end are short; the rest in their files' order.
LONGEST_FIRST = ("test_pdd.py", "test_claims.py", "test_soak.py", "test_pd.py", "test_cli_e2e.py",
                 "test_membership.py", "test_tool_parsers.py", "test_flood.py", "test_lifecycle.py", "test_sites.py",
                 "test_fuzz.py", "test_gpu_check.py", "test_router_api.py", "test_agent_loops.py")
VLLM_UNIT = "tests/test_vllm_*.py"


def _turn(path: Path) -> int:
    """Where a module's tests come in the run: the vLLM modules, the longest, the rest."""
    if _is_vllm_test(path):
        return 0
    return 1 + LONGEST_FIRST.index(path.name) if path.name in LONGEST_FIRST else 1 + len(LONGEST_FIRST)


@pytest.hookimpl(optionalhook=True)  # (a run without xdist: -p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` with the vLLM modules as one unit, in the collection's order (above)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class VllmTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return VLLM_UNIT if _is_vllm_test(Path(module)) else module

    config.option.loadscopereorder = False  # (xdist would put the units with the most tests first)
    return VllmTogether(config, log)


def pytest_configure(config: pytest.Config) -> None:
    _own_ports(config)
    config.addinivalue_line("markers", f"{CI_MAY_SKIP}: a skip of this test is no failure in CI (CI=true); "
                                       "only for what CI's machines cannot have, never for a missing package or file")


def _own_ports(config: pytest.Config) -> None:
    """Each xdist worker draws its ports (its own and those of the processes it starts, by
    `$PDD_PORTS`) from a share of pdd's range of its own: a port one worker drew for a child
    not yet listening is never drawn by the other worker's launch."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    low, high = port_range()
    share = (high - low) // int(worker["workercount"])
    first = low + share * int(worker["workerid"].removeprefix("gw"))
    os.environ[PORTS_ENV] = f"{first}-{first + share - 1}"


def _fail_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    if _is_vllm_test(Path(report.fspath)):
        report.longrepr = (f"vLLM backend test skipped ({reason}): a skip is a failure here — install the vllm "
                           f"extra (pip install -e '.[test,vllm]', as scripts/test.sh does), or leave the vLLM "
                           f"tests out with PDD_VLLM=0")
        return
    report.longrepr = (f"skipped in CI ({reason}): with CI set, a skip is a failure — install the test extras "
                       f"(pip install -e '.[test,vllm]') and commit the data the test reads, or mark the "
                       f"test @pytest.mark.{CI_MAY_SKIP} if CI's machines cannot run it")


def _skip_fails(path: Path) -> bool:
    """In CI every skip fails; a vLLM test's fails wherever it was asked for (they are only
    collected then)."""
    return in_ci() or _is_vllm_test(path)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _skip_fails(Path(report.fspath)):
        _fail_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and _skip_fails(Path(report.fspath)) and not hasattr(report, "wasxfail")
            and item.get_closest_marker(CI_MAY_SKIP) is None):
        _fail_skip(report)
    if report.failed and call.when == "call":
        _attach_deployment_logs(item, report)


# ---- a failed test against a deployment shows what its processes logged --------------------
# A module's deployment outlives the test that failed on it, so `procs.pdd_up` never sees the
# failure: its logs are read into the report here (a deployment a test starts itself prints
# them on the way out).
def _attach_deployment_logs(item: pytest.Item, report: pytest.TestReport) -> None:
    for value in getattr(item, "funcargs", {}).values():
        run_dir = getattr(value, "run_dir", None)
        if isinstance(run_dir, Path):
            from procs import logged_warnings  # (only where a deployment ran: procs is importable)

            report.sections.extend(logged_warnings(run_dir))


# ---- property tests run the same examples every time --------------------------------
# A property test draws its examples at random; on a shared, loaded machine a run that
# fails once and passes on the retry tells nobody anything. Seeded from each test's own
# code, every run (a developer's, CI's) tries the same examples, and one that fails
# fails again until the code changes. (No example database either: what one machine
# found must not change what another tests.) test_fuzz.py's settings already say so.
settings.register_profile("pdd", derandomize=True, database=None)
settings.load_profile("pdd")


# ---- fixtures --------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def pdd_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private PDD_HOME, so deployments the tests start use a model built here, once."""
    home = tmp_path_factory.mktemp("pdd-home")
    os.environ["PDD_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_model_dir(pdd_home: Path) -> Path:
    """The default tiny model (the one `pdd up` serves), built once per session."""
    from pdd.model.store import resolve_model

    return resolve_model("")


@pytest.fixture(scope="session")
def vllm_reference(tiny_model_dir: Path):
    """A plain `vllm serve` on the tiny model (fp32, eager), started once per test process for
    every vLLM test module (on two workers they all run on one: above), before the first
    module's deployment (beside it, the start of four vLLM servers at once starved the other
    worker's deployments)."""
    pytest.importorskip("vllm")
    from procs import plain_vllm

    with plain_vllm(tiny_model_dir) as ref:
        yield ref
