"""The first cell of every notebook: install ``course_attn`` when running in Google Colab.

The repository comes from ``_config.yml`` (``repository.url`` and ``repository.branch``), the same
place the book's "open in Colab" links come from. ``python -m course_attn.colab`` writes the cell
into every notebook of book/, solutions/ (and so exercises/, after ``make exercises``); a test
fails when a notebook's first cell differs from what the config says.
"""

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
MARK = "# Running in Google Colab?"


def repository(config: Path = ROOT / "_config.yml") -> tuple[str, str]:
    """(url, branch) of the course repository, read from the book's ``_config.yml``."""
    text = config.read_text(encoding="utf-8")
    block = re.search(r"^repository:\n((?:[ \t]+.*\n?)+)", text, re.M)
    if not block:
        raise ValueError(f"{config} has no 'repository:' section")
    fields = dict(re.findall(r"^\s+(\w+):\s*(\S+)", block.group(1), re.M))
    if "url" not in fields:
        raise ValueError(f"{config}: 'repository:' has no url")
    return fields["url"], fields.get("branch", "main")


def colab_cell_source(url: str, branch: str) -> str:
    return (
        f"{MARK} Install the course's package first; anywhere else this cell does nothing.\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        f'    %pip install --quiet "course_attn @ git+{url}@{branch}"'
    )


def has_colab_cell(nb) -> bool:
    return bool(nb.cells) and nb.cells[0].cell_type == "code" and nb.cells[0].source.startswith(MARK)


def stamp(path: Path, source: str) -> bool:
    """Make ``source`` the first cell of the notebook at ``path``; True if the file changed."""
    nb = nbformat.read(path, as_version=4)
    if has_colab_cell(nb):
        if nb.cells[0].source == source:
            return False
        nb.cells[0].source = source
    else:
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["remove-cell"]})
        cell.id = "colab-install"
        nb.cells.insert(0, cell)
    nbformat.write(nb, path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", default=["book", "solutions"])
    args = parser.parse_args(argv)
    source = colab_cell_source(*repository())
    for folder in args.folders:
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            if stamp(path, source):
                print(f"stamped {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
