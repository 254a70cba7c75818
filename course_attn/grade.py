"""Grade exercise notebooks, or a whole class; see ``course_attn.grading.cli``.

``python -m course_attn.grade PATH... [--json REPORT.json] [--timeout SECONDS] [--memory-mb MB]``
``python -m course_attn.grade SUBMISSIONS_DIR --gradebook OUT [--workers N] ...``
"""

from .grading.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
