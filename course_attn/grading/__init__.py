"""Exercises: what each one is (``exercise.py``, one module per chapter), the in-notebook
``check()``, generating exercise notebooks from solutions, and grading across a process
boundary (``grader.py``)."""

from .cases import expect_float_list, expect_number, expect_tensor
from .check import ExerciseFailed, check, run_exercise
from .exercise import Case, Exercise, Mistake, all_exercises, get, register

__all__ = ["Case", "Exercise", "ExerciseFailed", "Mistake", "all_exercises", "check",
           "expect_float_list", "expect_number", "expect_tensor", "get", "register",
           "run_exercise"]
