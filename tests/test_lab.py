"""``make lab`` in a real browser: JupyterLab serves the repository and opens in ``work/``, so an
exercise copied there by ``make work`` opens its chapter from its link ``../book/NN_name.ipynb``
(with ``work/`` as Lab's root, that link was "outside root contents directory").

The Makefile's own ``lab`` recipe runs, in a temporary copy of the layout (``work/`` with an
exercise, ``book/`` with the chapter it links), with this checkout's .venv; Debian's chromium,
driven by playwright, opens the exercise and clicks the link. Needs /usr/bin/chromium and
playwright: without them these tests skip, unless ``REQUIRE_BOOK=1`` (set by CI) turns a
missing piece into a failure, as in test_browser.py.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import chromium, require_browser

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
EXERCISE = "05_rope.ipynb"  # its first cell links to ../book/05_rope.ipynb
TOKEN = "course-attn-test-token"


require_browser(None if (VENV / ".installed").exists() and (VENV / "bin" / "jupyter").exists()
                else "the .venv is not installed (`make lab` or `make test` installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    """(HTTP status, body) of a GET with the test's token."""
    request = urllib.request.Request(url, headers={"Authorization": f"token {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """``make lab`` running in a copy of the course's layout: its address (no trailing /)."""
    course = tmp_path_factory.mktemp("course")
    (course / "work").mkdir()
    (course / "book").mkdir()
    shutil.copy(ROOT / "exercises" / EXERCISE, course / "work" / EXERCISE)
    shutil.copy(ROOT / "book" / EXERCISE, course / "book" / EXERCISE)
    for name in ("requirements.txt", "pyproject.toml"):  # older than .venv/.installed: no install
        shutil.copy(ROOT / name, course / name)
        os.utime(course / name, (0, 0))
    jupyter = course / ".jupyter"  # the user's Jupyter settings and workspaces left alone
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(jupyter / "config"),
           "JUPYTER_DATA_DIR": str(jupyter / "data"), "JUPYTER_RUNTIME_DIR": str(jupyter / "run"),
           "JUPYTERLAB_WORKSPACES_DIR": str(jupyter / "workspaces"),
           "JUPYTERLAB_SETTINGS_DIR": str(jupyter / "settings")}
    port = _free_port()
    log = (course / "lab.log").open("w")
    server = subprocess.Popen(
        ["make", "-s", "-f", str(ROOT / "Makefile"), "lab", f"VENV={VENV}",
         f"LAB_ARGS=--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={TOKEN}"],
        cwd=course, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 45
        while True:
            try:
                if _get(f"{address}/api/status")[0] == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"make lab did not start:\n{(course / 'lab.log').read_text()}")
            time.sleep(0.3)
        yield address
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # make and the Lab it started
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def test_lab_serves_the_repository_and_starts_in_work(lab):
    status, chapter = _get(f"{lab}/api/contents/book/{EXERCISE}?content=0")
    assert status == 200 and json.loads(chapter)["type"] == "notebook", chapter
    status, page = _get(f"{lab}/lab")
    assert status == 200 and '"preferredPath": "work"' in page  # the file browser opens in work/


def test_an_exercises_chapter_link_opens_in_lab(lab):
    with chromium() as browser:
        page = browser.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if "outside root" in m.text
                else None)
        page.goto(f"{lab}/lab/tree/work/{EXERCISE}?token={TOKEN}", timeout=60_000)
        link = page.locator(".jp-RenderedMarkdown a", has_text="Chapter 5").first
        link.wait_for(timeout=60_000)
        with page.expect_response(lambda r: f"/api/contents/book/{EXERCISE}" in r.url,
                                  timeout=30_000) as opened:
            link.click()
        assert opened.value.status == 200
        page.wait_for_url(f"**/lab/tree/book/{EXERCISE}*", timeout=30_000)
        assert not errors, errors
        assert page.locator(".jp-Dialog").count() == 0, page.locator(".jp-Dialog").inner_text()
