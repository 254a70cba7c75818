# Root pytest config: what is not a test even though pytest could collect it, and the order
# in which `make test`'s workers take the files.
import os

collect_ignore_glob = ["_build/*", ".venv/*", "tests/fixtures/*"]

# `make test` runs pytest-xdist's workers (`-n <cores + 1> --dist loadfile`: each file on one
# worker, so that nbval's cells of a notebook run in order in one kernel). A worker takes the
# next file in collection order; a long file taken last would leave the other workers idle, so
# the slowest files (measured with --durations, issue 35; the table at the end of each run
# since issue 45) come first.
SLOWEST_FIRST = [f"tests/test_{name}.py" for name in (
    "book_catches_bugs", "grading_batch", "grading_attacks", "browser", "hidden_regimes",
    "exercises_conformance",
    "grading_honest", "grading", "checks_ch08", "workspace", "export", "grading_sandbox")]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker for torch and what it starts (kernels, graders): the workers share
    # the cores, and OpenMP's threads spin while waiting for each other.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


# The time each file took (its tests' set-up, call and tear-down, on whichever worker ran it),
# printed at the end of every run, slowest first: so that the next slow file is seen.
_FILE_SECONDS: dict[str, float] = {}
FILES_SHOWN = 15


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    terminalreporter.section(f"the {FILES_SHOWN} slowest files (seconds, summed over their tests)")
    total = sum(_FILE_SECONDS.values())
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:FILES_SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f}  {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:8.1f}  100.0%  every file ({len(_FILE_SECONDS)})")
