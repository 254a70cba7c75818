"""CI runs what the README says, in the README's order: `.ci/run` here, and the GitHub Actions
workflow (linted by actionlint) in a user's own repository, which also publishes the book."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
STUDENT_ORDER = ["test", "book", "work", "lab", "grade"]


def readme_blocks() -> list[list[str]]:
    """The commands of each ```bash block of the README, comments and blank lines left out."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    return [[line.split("#", 1)[0].strip() for line in block.splitlines()
             if line.split("#", 1)[0].strip()] for block in blocks]


def readme_ci_commands() -> list[str]:
    """The README's first commands: installing and testing, what CI runs."""
    return readme_blocks()[0]


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def test_readme_walks_a_student_through_the_commands_in_order():
    targets = [line.split()[1] for block in readme_blocks() for line in block
               if line.startswith("make ")]
    first_seen = list(dict.fromkeys(targets))
    assert first_seen[:len(STUDENT_ORDER)] == STUDENT_ORDER
    assert readme_ci_commands() == ["make test", "make book"]


def test_every_make_command_in_the_readme_exists():
    text = README.read_text(encoding="utf-8")
    quoted = set(re.findall(r"\bmake ([a-z][\w-]*)", text))
    assert quoted - makefile_targets() == set(), "the README names make targets that do not exist"


def test_make_test_builds_the_book_first_so_the_book_tests_have_pages_to_read():
    """The README's order (test, then book) works from a fresh clone: `make test` does not rely
    on a book built before it, and the book's tests never find it missing."""
    plan = subprocess.run(["make", "-n", "-o", ".venv/.installed", "test"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    build = next(i for i, line in enumerate(lines) if "jupyter-book build" in line)
    tests = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert build < tests


@pytest.fixture
def ci_clone(tmp_path):
    """A copy of .ci/run in an empty repository, with fakes for make, chromium, bwrap and
    apt-get that log how they were called; ``run(fail_on=...)`` runs it as CI does (no stdin,
    CI=true); ``missing`` names the programs to take away first."""
    (tmp_path / ".ci").mkdir()
    shutil.copy2(CI_RUN, tmp_path / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    fakes = {
        "make": 'echo "make $* REQUIRE_BOOK=${REQUIRE_BOOK:-}" >> "$LOG"; [ "$1" != "$FAIL_ON" ]',
        "apt-get": 'echo "apt-get $*" >> "$LOG"',
        "chromium": "exit 0",
        "bwrap": "exit 0",
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    os.symlink(shutil.which("dirname"), bin_dir / "dirname")

    def run(fail_on: str = "", missing: tuple = ()):
        for program in missing:
            (bin_dir / program).unlink(missing_ok=True)
        env = {"PATH": str(bin_dir), "LOG": str(log), "FAIL_ON": fail_on, "CI": "true"}
        done = subprocess.run([shutil.which("bash"), str(tmp_path / ".ci" / "run")], env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=60)
        calls = log.read_text().splitlines() if log.exists() else []
        return done, calls

    return run


def test_ci_runs_the_readme_commands_in_the_readme_order(ci_clone):
    done, calls = ci_clone()
    assert done.returncode == 0, done.stderr
    assert calls == [f"{command} REQUIRE_BOOK=1" for command in readme_ci_commands()]


def test_ci_fails_and_stops_when_a_command_fails(ci_clone):
    done, calls = ci_clone(fail_on="test")
    assert done.returncode != 0
    assert calls == ["make test REQUIRE_BOOK=1"]


@pytest.mark.parametrize("missing, packages", [
    (("chromium",), ["chromium"]), (("bwrap",), ["bubblewrap"]),
    (("chromium", "bwrap"), ["chromium", "bubblewrap"])])
def test_ci_installs_what_is_missing_from_debian(ci_clone, missing, packages):
    """Debian's chromium for the browser test, bubblewrap for the grader's sandbox."""
    done, calls = ci_clone(missing=missing)
    assert done.returncode == 0, done.stderr
    install = [c for c in calls if c.startswith("apt-get install")]
    assert calls[0] == "apt-get update -q" and len(install) == 1
    assert install[0].split()[-len(packages):] == packages and " -y " in install[0]


def test_ci_installs_nothing_when_nothing_is_missing(ci_clone):
    done, calls = ci_clone()
    assert done.returncode == 0, done.stderr
    assert not [c for c in calls if c.startswith("apt-get")]


def actionlint() -> str:
    """The actionlint binary that requirements.txt installs beside this Python."""
    found = shutil.which("actionlint", path=str(Path(sys.executable).parent)) \
        or shutil.which("actionlint")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("actionlint is not installed: `pip install -r requirements.txt`")
        pytest.skip("actionlint is not installed")
    return found


def lint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([actionlint(), "-no-color", *map(str, paths)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_there_is_a_workflow():
    assert WORKFLOWS, "no workflow in .github/workflows"


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_passes_actionlint(workflow):
    done = lint(workflow)
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    """The lint test above can fail: a misspelt input and an unknown expression are caught."""
    text = WORKFLOWS[0].read_text()
    broken = tmp_path / "broken.yml"
    broken_text = (text.replace("python-version:", "python_version:")
                   .replace("github.event_name", "github.event_nam"))
    assert broken_text != text
    broken.write_text(broken_text)
    done = lint(broken)
    assert done.returncode != 0
    assert "python_version" in done.stdout and "event_nam" in done.stdout


def load(workflow: Path) -> dict:
    data = yaml.safe_load(workflow.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads a bare `on` as True
    return data


def steps_running(job: dict) -> list[str]:
    return [step["run"].strip() for step in job.get("steps", []) if "run" in step]


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_runs_the_readme_commands_in_order_on_ubuntu(workflow):
    jobs = load(workflow)["jobs"]
    ci = [job for job in jobs.values() if set(readme_ci_commands()) <= set(steps_running(job))]
    assert ci, f"no job of {workflow.name} runs {readme_ci_commands()}"
    job = ci[0]
    assert str(job["runs-on"]).startswith("ubuntu")
    runs = [r for r in steps_running(job) if r in readme_ci_commands()]
    assert runs == readme_ci_commands()
    assert str(job["env"]["REQUIRE_BOOK"]) == "1"  # the book's tests may not skip there either


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_publishes_the_built_book_to_pages_on_push_to_main(workflow):
    data = load(workflow)
    assert "main" in data["on"]["push"]["branches"]
    steps = {step.get("uses", "").split("@")[0]: (job_name, step)
             for job_name, job in data["jobs"].items() for step in job.get("steps", [])}
    job_name, upload = steps["actions/upload-pages-artifact"]
    assert upload["with"]["path"] == "_build/html"
    assert "refs/heads/main" in upload["if"] and "push" in upload["if"]
    deploy_job_name, _ = steps["actions/deploy-pages"]
    deploy_job = data["jobs"][deploy_job_name]
    assert deploy_job["needs"] == job_name
    assert "refs/heads/main" in deploy_job["if"]
    assert deploy_job["permissions"] == {"pages": "write", "id-token": "write"}


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_tests_the_oldest_and_newest_python_and_torch(workflow):
    """The package and the grader run on the oldest Python and torch that pyproject.toml
    allows, and on the newest Python with the pinned torch (issue 21)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest_python = re.fullmatch(r">=\s*(3\.\d+)", project["requires-python"]).group(1)
    [torch_spec] = [d for d in project["dependencies"] if d.startswith("torch")]
    oldest_torch = re.fullmatch(r"torch>=\s*([\d.]+)", torch_spec).group(1)
    pinned = re.search(r"^torch==([\d.]+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    cells = [(str(c["python"]), str(c["torch"])) for job in load(workflow)["jobs"].values()
             for c in job.get("strategy", {}).get("matrix", {}).get("include", [])]
    assert any(p == oldest_python and t.startswith(oldest_torch) for p, t in cells), cells
    assert any(p == "3.13" and t == pinned for p, t in cells), cells


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_keeps_the_notebooks_execution_cache_per_package(workflow):
    steps = [s for job in load(workflow)["jobs"].values() for s in job.get("steps", [])
             if s.get("uses", "").startswith("actions/cache@")]
    [cache] = [s for s in steps if s["with"]["path"] == "_build/.jupyter_cache"]
    # a cache from another version of the package is never restored: jupyter-cache only
    # knows the notebooks, and would keep outputs the package no longer gives
    assert "course_attn/**" in cache["with"]["key"]
    assert all("course_attn/**" in line for line in cache["with"]["restore-keys"].split("\n")
               if line.strip())
