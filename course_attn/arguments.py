"""Checks of plain arguments that the package's classes and functions share."""


def check_positive_ints(**values) -> None:
    """ValueError naming the first of ``values`` that is not a positive int (bools are not)."""
    for name, n in values.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
