"""Grade exercise notebooks; see ``course_attn.grading.grader``.

``python -m course_attn.grade PATH... [--json REPORT.json] [--timeout SECONDS] [--solutions DIR]``
"""

from .grading.grader import main

if __name__ == "__main__":
    raise SystemExit(main())
