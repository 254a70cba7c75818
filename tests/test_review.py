"""The review scan reads names as Python resolves them (issue 41): imports and aliases followed,
a string that is used as a name read as that name, frames reached through tracebacks and
``inspect`` seen; and everyday code that reaches neither the grader nor the guard is not
flagged. In this process, on code that is never run."""

import pytest

from course_attn.grading import review


def signs(*cells: str) -> set[str]:
    """The kinds of sign the scan finds in these cells (the text after the cells' names)."""
    found = set()
    for flag in review.review_flags(list(enumerate(cells))):
        found |= {why for why in vars(review).values() if isinstance(why, str) and
                  flag.endswith(" " + why)}
    return found


NAMED_BY_STRINGS = {
    "vars(module)[name]": ("f = vars(harness)['__globals__']", review.DUNDERS),
    "getattr of a dunder": ("g = getattr(report, '__globals__')", review.DUNDERS),
    "setattr of a mode's hook": ("import torch.overrides as o\n"
                                 "setattr(o, '_get_current_function_mode_stack', list)",
                                 review.DISPATCH),
    "__dict__[name] written": ("torch.__dict__['_C'] = None", review.C_CORE),
    "from gc import": ("from gc import get_objects\nobjects = get_objects()", review.GC),
    "from torch import _C": ("from torch import _C\n_C._set_grad_enabled(True)", review.C_CORE),
    "from os import posix_spawn": ("from os import posix_spawn as start", review.PROCESSES),
    "an alias of an alias": ("import gc as g\ncollector = g\ncollector.get_objects()",
                             review.GC),
    "a traceback's frame": ("import sys\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n"
                            "    frame = sys.exc_info()[2].tb_frame", review.STACK),
    "traceback.walk_stack": ("import traceback\nframes = list(traceback.walk_stack(None))",
                             review.STACK),
    "inspect.getargvalues": ("import inspect\ninspect.getargvalues(frame)", review.STACK),
    "inspect.getclosurevars": ("from inspect import getclosurevars\ngetclosurevars(f)",
                               review.STACK),
    "a name folded from pieces": ("import sys\nname = '_get' + 'frame'\nf = getattr(sys, name)",
                                  review.STACK),
    "a joined name": ("import sys\nf = getattr(sys, ''.join(['_get', 'frame']))", review.STACK),
    "an f-string name": ("import sys\nhalf = 'frame'\nf = getattr(sys, f'_get{half}')",
                         review.STACK),
    "a string kept elsewhere": ("cfg.name = '_C'\ncore = getattr(torch, cfg.name)",
                                review.C_CORE),
    "importlib of gc": ("import importlib\nm = importlib.import_module('gc')\nm.get_objects()",
                        review.GC),
    "sys.modules by key": ("import sys\ng = sys.modules['gc']\ng.get_objects()", review.GC),
    "a computed name on sys": ("import sys\nf = getattr(sys, input())", review.COMPUTED),
    "the module table rewritten": ("import sys\nsys.modules['torch'] = None", review.HOOKS),
    "the module table searched": ("import sys\nfor m in list(sys.modules.values()): pass",
                                  review.C_CORE),
    "a multiprocessing pool": ("import multiprocessing as mp\npool = mp.Pool(2)",
                               review.PROCESSES),
    "a task on torch's inter-op pool": ("fut = torch.jit.fork(serve, box)", review.RAW_THREADS),
    "a mode defined": ("class M(torch.overrides.TorchFunctionMode):\n    pass", review.DISPATCH),
    "subclasses searched": ("[c for c in ().__class__.__base__.__subclasses__()]",
                            review.OBJECTS),
}


@pytest.mark.parametrize("name", NAMED_BY_STRINGS)
def test_a_route_to_the_guard_is_flagged_however_it_is_named(name):
    code, why = NAMED_BY_STRINGS[name]
    assert why in signs(code), (name, signs(code))


EVERYDAY = {
    "multiprocessing.cpu_count()": "import multiprocessing\nn = multiprocessing.cpu_count()",
    "google.colab in sys.modules": "import sys\nIN_COLAB = 'google.colab' in sys.modules\n"
                                   "colab = sys.modules.get('google.colab')",
    "printing __dict__": "print(cfg.__dict__)\nprint(vars(cfg))",
    "getattr with the student's config": "dtype = getattr(torch, cfg.dtype_name)\n"
                                         "setattr(cfg, 'seed', 0)",
    "getattr with a plain name": "dtype = getattr(torch, 'float16')",
    "a main guard and dunders of every day": "class A:\n    def __init__(self):\n"
                                             "        super().__init__()\n"
                                             "if __name__ == '__main__':\n"
                                             "    print(type(A()).__name__, A.__doc__)",
    "magics, shell lines, help": "%matplotlib inline\n!ls\ntorch.softmax?\nx = 1  # why?",
    "re.compile and a variable named compile": "import re\npattern = re.compile('a+')\n"
                                               "compile_time = 3",
    "gc.collect for memory": "import gc\ngc.collect()",
    "a traceback printed": "import traceback\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n"
                           "    traceback.print_exc()",
    "inspect.signature": "import inspect\nprint(inspect.signature(print))",
    "a string about frames in prose": "note = 'the frame of the plot'\n'''the _C extension'''",
    "a dunder-shaped key as data": "wire = {'__tensor__': {'dtype': 'float32'}}",
}


@pytest.mark.parametrize("name", EVERYDAY)
def test_everyday_code_is_not_flagged(name):
    assert signs(EVERYDAY[name]) == set(), name


def test_a_name_bound_in_one_cell_is_resolved_in_another():
    assert review.GC in signs("from gc import get_referrers as who", "who(torch)")


def test_a_helper_file_is_read_as_a_cell_is():
    flags = review.review_flags([(0, "import helpers")], helpers={
        "helpers.py": b"from torch import _C\n"})
    assert flags == [f"for review (no points lost): helpers.py {review.C_CORE}"]


def test_a_cell_that_is_not_python_is_read_as_written():
    # a %%bash cell: no Python parse, its dotted names are still read
    assert review.STACK in signs("%%bash\npython -c 'import sys' ; echo sys._getframe")
