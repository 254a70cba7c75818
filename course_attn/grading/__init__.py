"""Exercises: checks for notebooks, generating exercises from solutions, and grading."""

from .registry import Case, ExerciseFailed, assert_close, check, exercise, exercises, run_checks

__all__ = ["Case", "ExerciseFailed", "assert_close", "check", "exercise", "exercises", "run_checks"]
