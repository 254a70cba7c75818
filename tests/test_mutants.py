"""``make mutants`` (course_attn/grading/mutants.py): the mutants of each exercise's reference,
each run on the public cases and the hidden cases of 20 seeds, must lose points on every seed,
or be listed as equivalent with a reason. The make target runs every exercise; this runs the
mutator on a function of its own and the whole check on a sample of exercises."""

import ast

import pytest

from course_attn.grading.exercise import load_hidden
from course_attn.grading.mutants import equivalent_list, mutant_functions, mutations, run

from helpers import SOLUTIONS_DIR

SAMPLE = ("ch03.causal_mask", "ch09.tile_mask", "ch12.run_requests", "ch02.attention_cost")


def sample(a, b, items):
    """A function with one site of every kind of mutation."""
    total = a - b
    if total < 2 and not items:
        total = -total
    return divmod(total, 3), items[1:a] + items[:2], a > 0 or b > 0


def test_every_kind_of_mutation_is_made_and_each_changes_one_thing():
    import inspect
    source = inspect.getsource(sample)
    made = [description.split(": ", 1)[1] for description, _ in mutations(source)]
    for expected in ("- -> +", "a - b -> a", "a - b -> b", "< -> <=", "< -> >", "2 -> 3",
                     "2 -> 1", "not x -> x", "-x -> x", "slice upper bound +1",
                     "slice upper bound -1", "the first two arguments of a call swapped",
                     "or -> and", "> -> >="):
        assert expected in made, (expected, made)
    original = ast.dump(ast.parse(source))
    assert all(ast.dump(tree) != original for _, tree in mutations(source))


def test_the_mutants_run_and_differ_from_the_original_somewhere():
    functions = dict(mutant_functions(sample))
    assert len(functions) == len(mutations(__import__("inspect").getsource(sample)))
    inputs = [(a, b, items) for a in range(-1, 4) for b in range(-1, 4)
              for items in ([], [1], [1, 2, 3, 4, 5])]
    for description, mutant in functions.items():
        differs = False
        for args in inputs:
            try:
                differs |= mutant(*args) != sample(*args)
            except Exception:
                differs = True
        assert differs, description


def test_each_listed_equivalent_mutant_has_a_reason():
    for (key, mutation), reason in equivalent_list().items():
        assert key.startswith("ch") and mutation.startswith("line ") and len(reason) > 20, \
            (key, mutation, reason)


@pytest.mark.parametrize("key", SAMPLE)
def test_every_mutant_of_the_reference_loses_points_on_every_seed_or_is_equivalent(key):
    load_hidden(SOLUTIONS_DIR)
    outcome = run(key, range(20))
    assert outcome.mutants > 0, key
    assert not outcome.partly, outcome.partly
    assert not outcome.survived, outcome.survived
