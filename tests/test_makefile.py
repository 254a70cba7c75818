"""``make help`` (and ``make`` alone): every command of the Makefile with its description, the
``## `` comment above its target, without installing anything."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def phony_targets() -> list[str]:
    line = next(line for line in MAKEFILE.read_text().splitlines() if line.startswith(".PHONY:"))
    return line.split(":", 1)[1].split()


def descriptions() -> dict[str, str]:
    """target -> its ``## `` comment lines, joined by spaces ("" for a target without one)."""
    found, text = {}, []
    for line in MAKEFILE.read_text().splitlines():
        if line.startswith("## "):
            text.append(line[3:])
            continue
        if (target := re.match(r"([a-z][a-z-]*):", line)) is not None:
            found[target[1]] = " ".join(text)
        text = []
    return found


def make(*args: str, cwd: Path) -> str:
    """``make -s ARGS`` with the course's Makefile, run in ``cwd`` (where .venv would appear)."""
    done = subprocess.run(["make", "-s", "-f", str(MAKEFILE), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_command_has_a_description():
    targets, described = phony_targets(), descriptions()
    assert "help" in targets
    assert not [t for t in targets if not described.get(t)]


def test_make_help_lists_every_command_with_its_description_and_installs_nothing(tmp_path):
    out = make("help", cwd=tmp_path)
    assert not (tmp_path / ".venv").exists()
    listed = re.findall(r"^make (\S+) ", out, flags=re.MULTILINE)
    assert sorted(listed) == sorted(phony_targets())
    words = " ".join(out.split())  # the descriptions, wrapped
    for target, text in descriptions().items():
        assert f"make {target} {' '.join(text.split())}" in words, target
    assert max(len(line) for line in out.splitlines()) <= 100


def test_make_alone_is_make_help(tmp_path):
    assert make(cwd=tmp_path) == make("help", cwd=tmp_path)
    assert not (tmp_path / ".venv").exists()
