"""Grade exercise notebooks, or a whole class; see ``course_attn.grading.batch``.

``python -m course_attn.grade PATH... [--json REPORT.json] [--timeout SECONDS] [--memory-mb MB]``
``python -m course_attn.grade SUBMISSIONS_DIR --gradebook OUT [--workers N] ...``
"""

from .grading.batch import main

if __name__ == "__main__":
    raise SystemExit(main())
