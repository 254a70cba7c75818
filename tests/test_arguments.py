"""The shared argument checks: what they accept, and errors that name the argument and value."""

import pytest

from course_attn.arguments import check_non_negative_ints, check_positive_ints


def test_valid_ints_pass():
    check_positive_ints(a=1, b=10**12)
    check_non_negative_ints(a=0, b=3)
    check_positive_ints()                                    # nothing to check


@pytest.mark.parametrize("check, value, wording", [
    (check_positive_ints, 0, "a positive int"),
    (check_positive_ints, -3, "a positive int"),
    (check_non_negative_ints, -1, "a non-negative int"),
])
def test_ints_out_of_range_are_refused(check, value, wording):
    with pytest.raises(ValueError, match=f"^n must be {wording}, got {value}$"):
        check(n=value)


@pytest.mark.parametrize("check", [check_positive_ints, check_non_negative_ints])
@pytest.mark.parametrize("value", [True, False, 2.0, "4", None])
def test_bools_floats_and_other_types_are_refused(check, value):
    """A bool is an int to Python, but True is never meant as a count."""
    with pytest.raises(ValueError, match=f"^n must be .*, got {value!r}$"):
        check(n=value)


def test_the_first_bad_argument_is_named():
    with pytest.raises(ValueError, match="^second must be a positive int, got 0$"):
        check_positive_ints(first=2, second=0, third=-1)
