# Root pytest config: what is not a test even though pytest could collect it, and the order
# in which `make test`'s workers take the files.
import os

collect_ignore_glob = ["_build/*", ".venv/*", "tests/fixtures/*"]

# `make test` runs pytest-xdist's workers (`-n <cores + 1> --dist loadfile`: each file on one
# worker, so that nbval's cells of a notebook run in order in one kernel). A worker takes the
# next file in collection order; a long file taken last would leave the other workers idle, so
# the slowest files (measured with --durations, issue 35) come first.
SLOWEST_FIRST = [f"tests/test_{name}.py" for name in (
    "grading_batch", "grading_attacks", "browser", "hidden_regimes", "exercises_conformance",
    "grading_honest", "grading", "checks_ch08", "workspace", "export", "grading_sandbox")]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker for torch and what it starts (kernels, graders): the workers share
    # the cores, and OpenMP's threads spin while waiting for each other.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
