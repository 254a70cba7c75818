"""Checks of plain arguments that the package's classes and functions share."""


def _check_ints(values: dict, lowest: int, wording: str) -> None:
    for name, n in values.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < lowest:
            raise ValueError(f"{name} must be {wording}, got {n!r}")


def check_positive_ints(**values) -> None:
    """ValueError naming the first of ``values`` that is not a positive int (bools are not)."""
    _check_ints(values, 1, "a positive int")


def check_non_negative_ints(**values) -> None:
    """ValueError naming the first of ``values`` that is not an int >= 0 (bools are not)."""
    _check_ints(values, 0, "a non-negative int")
