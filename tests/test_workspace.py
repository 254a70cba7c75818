"""A student's own folder: `make work CH=NN` copies an exercise into work/ and never overwrites
a copy, `make lab` opens JupyterLab there, `make grade` grades what is there."""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from course_attn.workspace import copy_to_work, find_exercise, main, notebook_to_copy

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))[-1]  # e.g. 03_masking.ipynb
NUMBER = CHAPTER.name[:2]
VENV = Path(sys.executable).parent.parent


@pytest.fixture
def exercises(tmp_path) -> Path:
    folder = tmp_path / "exercises"
    folder.mkdir()
    for name in ("01_intuition.ipynb", "02_scaled_dot_product.ipynb", "03_masking.ipynb"):
        (folder / name).write_text(json.dumps({"name": name}))
    return folder


@pytest.mark.parametrize("chapter", ["3", "03", "03_masking", "masking", "03_masking.ipynb"])
def test_a_chapter_is_found_however_it_is_named(exercises, chapter):
    assert find_exercise(chapter, exercises) == exercises / "03_masking.ipynb"


@pytest.mark.parametrize("chapter", ["07", "0", "attention"])
def test_an_unknown_chapter_names_the_ones_there(exercises, chapter):
    with pytest.raises(ValueError, match="01_intuition, 02_scaled_dot_product, 03_masking"):
        find_exercise(chapter, exercises)


def test_a_missing_exercises_folder_says_where_to_run(tmp_path):
    with pytest.raises(ValueError, match="run this from the course's folder"):
        find_exercise("03", tmp_path / "nowhere")


def test_a_path_is_copied_as_it_is(exercises, tmp_path):
    assert notebook_to_copy(str(exercises / "02_scaled_dot_product.ipynb")) == \
        exercises / "02_scaled_dot_product.ipynb"
    with pytest.raises(ValueError, match="no such notebook"):
        notebook_to_copy(str(tmp_path / "gone" / "x.ipynb"), exercises)


def test_copy_never_overwrites_the_students_copy(exercises, tmp_path):
    work = tmp_path / "work"
    copy = copy_to_work(exercises / "03_masking.ipynb", work)
    assert copy == work / "03_masking.ipynb"
    assert copy.read_bytes() == (exercises / "03_masking.ipynb").read_bytes()
    copy.write_text("my answers")
    with pytest.raises(FileExistsError, match="it is your work, so nothing was copied"):
        copy_to_work(exercises / "03_masking.ipynb", work)
    assert copy.read_text() == "my answers"


def test_command_copies_then_refuses(exercises, tmp_path, capsys):
    args = ["03", "--exercises", str(exercises), "--work", str(tmp_path / "work")]
    assert main(args) == 0
    copy = tmp_path / "work" / "03_masking.ipynb"
    assert f"make grade NB={copy}" in capsys.readouterr().out
    copy.write_text("my answers")
    assert main(args) == 1
    assert f"{copy} already exists" in capsys.readouterr().err
    assert copy.read_text() == "my answers"
    assert main(["09", "--exercises", str(exercises)]) == 2
    assert "matches no exercise notebook" in capsys.readouterr().err


def make(*args: str, work: Path, timeout: float = 120, **popen) -> subprocess.CompletedProcess:
    """`make ARGS` in the repository, with this Python's environment as the venv and ``work`` as
    the student's folder; the venv is taken as installed (`-o`), never rebuilt by a test."""
    command = ["make", "-s", "-o", str(VENV / ".installed"), f"VENV={VENV}",
               f"PY={sys.executable}", f"WORK={work}", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **popen)


def require(module: str) -> None:
    """Skip without ``module``, except in CI, where requirements.txt must have installed it."""
    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed: `pip install -r requirements.txt`")
        pytest.skip(f"{module} is not installed")


def test_make_work_copies_a_chapter_and_keeps_the_students_copy(tmp_path):
    work = tmp_path / "work"
    done = make("work", f"CH={NUMBER}", work=work)
    assert done.returncode == 0, done.stderr
    copy = work / CHAPTER.name
    assert copy.read_bytes() == CHAPTER.read_bytes()
    copy.write_text("my answers")
    # The same exercise again, named by its path as the generator's refusal message does.
    again = make("work", f"NB=exercises/{CHAPTER.name}", work=work)
    assert again.returncode != 0 and "already exists" in again.stderr
    assert copy.read_text() == "my answers"
    assert "make work CH=03" in make("work", work=work).stderr  # says what to type


def test_make_grade_with_nothing_in_work_says_what_to_do(tmp_path):
    done = make("grade", work=tmp_path / "empty")
    assert done.returncode != 0
    assert "has no notebook to grade yet: start one with make work CH=03" in done.stderr


def test_make_grade_passes_a_notebook_and_a_report_to_the_grader(tmp_path):
    plan = make("-n", "grade", "NB=work/03_masking.ipynb", "JSON=report.json", work=tmp_path)
    assert f"{sys.executable} -m course_attn.grade work/03_masking.ipynb --json report.json" \
        in plan.stdout


def test_make_grade_grades_a_fresh_copy_at_zero(tmp_path):
    require("nbclient")
    work = tmp_path / "work"
    assert make("work", f"CH={NUMBER}", work=work).returncode == 0
    report = tmp_path / "report.json"
    done = make("grade", f"JSON={report}", work=work, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert CHAPTER.name in done.stdout
    assert report.is_file() and json.loads(report.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""


def test_make_lab_starts_jupyterlab_in_work(tmp_path):
    """`make lab` as the README says, headless on 127.0.0.1, in a copy of the course's layout:
    its API answers, with a token, serves the course's root and shows work/; then it is
    stopped, whatever happened."""
    require("jupyterlab")
    course = tmp_path / "course"
    (course / "work").mkdir(parents=True)
    (course / "work" / "mine.ipynb").write_text(CHAPTER.read_text())
    for name in ("requirements.txt", "pyproject.toml"):  # older than .venv/.installed: no install
        shutil.copy(ROOT / name, course / name)
        os.utime(course / name, (0, 0))
    port, token = free_port(), "course-test-token"
    lab_args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token}"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    command = ["make", "-s", "-f", str(ROOT / "Makefile"), "-o", str(VENV / ".installed"),
               f"VENV={VENV}", f"LAB_ARGS={lab_args}", "lab"]
    log = (tmp_path / "lab.log").open("w")
    lab = subprocess.Popen(command, cwd=course, env=env, stdin=subprocess.DEVNULL, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and lab.poll() is None:
            try:
                status, _ = get(f"{base}/api/status?token={token}")
            except OSError:
                status = None  # not listening yet
            if status == 200:
                break
            time.sleep(0.5)
        output = (tmp_path / "lab.log").read_text()
        assert status == 200, f"JupyterLab did not answer (exit {lab.poll()}):\n{output[-3000:]}"
        assert get(f"{base}/api/status")[0] == 403  # nothing without the token
        code, body = get(f"{base}/api/contents?token={token}")
        assert code == 200 and "work" in [item["name"] for item in json.loads(body)["content"]]
        code, body = get(f"{base}/api/contents/work?token={token}")
        assert code == 200
        assert [item["name"] for item in json.loads(body)["content"]] == ["mine.ipynb"]
        assert get(f"{base}/lab?token={token}")[0] == 200
    finally:
        if lab.poll() is None:
            os.killpg(lab.pid, signal.SIGTERM)  # make and the JupyterLab it started
            try:
                lab.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(lab.pid, signal.SIGKILL)
                lab.wait(timeout=20)
        log.close()
