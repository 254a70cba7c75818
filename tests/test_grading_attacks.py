"""Every attack of issue 8 on the real chapters scores below full marks, with a reason that names
it; resource attacks cost only the exercise they hit.

Before the grade moved out of the student's process, each of these scored 10 of 10 on
``03_masking`` with a wrong or copied answer: patching the comparison or a builtin the tamper
check used (``sorted``), calling the reference from a thread, answering the public cases from a
table, an input transformer that rewrote the check cells, adjusting the call watcher's state,
calling a sibling function of the package, reading ``solutions/`` next to the package, and a
process in a new session that rewrote the ``--json`` report after the grader wrote it. And a
kernel that died or hung cost every later exercise; a ``while True:`` after a correct function
was not flagged.

Each submission is a solution notebook (``solutions/NN_*.ipynb``) with one exercise's answer
replaced by the attack. The attacked exercise must score 0 with the reason given here; the
others keep their points (unless they build on the attacked function, as ch03.document_mask
builds on causal_mask). All submissions are graded in one call, two at a time; the ones that
need a time limit in a second call, with a shorter one.
"""

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

from grading_support import (  # noqa: E402
    SOLUTIONS, by_grade_id, edit, live_processes, run_grader, solution_notebook, write,
)

from course_attn.grading import grader  # noqa: E402

CH02, CH03 = SOLUTIONS / "02_scaled_dot_product.ipynb", SOLUTIONS / "03_masking.ipynb"
BANNED = "calls {}, which this exercise does not allow: write the computation yourself"
SWITCHED = "switches off the watch for banned calls ({}), which no exercise allows"

# --- the attacks ----------------------------------------------------------------------------

PATCHED_COMPARISONS = '''import builtins
import torch
import torch.testing
import course_attn.grading.cases as cases
import course_attn.grading.judge as judge

builtins.sorted = lambda *args, **kwargs: []          # the old tamper check called sorted()
cases.expect_tensor = lambda *args, **kwargs: None    # the comparison, in the kernel
judge.judge_case = lambda *args, **kwargs: judge.CaseResult("all", True)
torch.testing.assert_close = lambda *args, **kwargs: None
torch.equal = lambda *args, **kwargs: True
torch.Tensor.__ne__ = lambda self, other: torch.zeros_like(self, dtype=torch.bool)

def causal_mask(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool)       # wrong
'''

REFERENCE_IN_A_THREAD = '''import threading
import course_attn

def causal_mask(tq, tk):
    out = []
    helper = threading.Thread(target=lambda: out.append(course_attn.causal_mask(tq, tk)))
    helper.start()
    helper.join()
    return out[0]
'''

REFERENCE_IN_A_WARM_POOL = '''from concurrent.futures import ThreadPoolExecutor
import course_attn

pool = ThreadPoolExecutor(max_workers=1)
pool.submit(lambda: None).result()   # its thread runs from now on, before any grading

def causal_mask(tq, tk):
    return pool.submit(course_attn.causal_mask, tq, tk).result()
'''

REFERENCE_IN_A_RAW_THREAD = '''import _thread
import time
import course_attn

def causal_mask(tq, tk):
    out = []
    _thread.start_new_thread(lambda: out.append(course_attn.causal_mask(tq, tk)), ())
    while not out:
        time.sleep(0.001)
    return out[0]
'''

LOOKUP_TABLE = '''import course_attn

PUBLIC = [(4, 4), (1, 1), (3, 6), (1, 5), (5, 3)]   # the public cases, as check() shows them
TABLE = {shape: course_attn.causal_mask(*shape) for shape in PUBLIC}   # recorded before grading

def causal_mask(tq, tk):
    if (tq, tk) in TABLE:
        return TABLE[(tq, tk)].clone()
    return torch.ones(tq, tk, dtype=torch.bool)
'''

TRANSFORMER_FORGES_CHECKS = '''import re

def forge(lines):
    text = "".join(lines)
    match = re.search(r'check\\("(ch03\\.\\w+)"', text)
    if match:  # a check cell: print a pass instead of running it
        return [f"print('{match.group(1)}: 5/5 checks passed')\\n"]
    return lines

get_ipython().input_transformers_cleanup.append(lambda lines: lines)
get_ipython().input_transformers_post.append(forge)

def causal_mask(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool)       # wrong
'''

TRANSFORMERS_REWRITE_THE_GRADER = '''import ast
import course_attn

def no_watch(lines):
    text = "".join(lines)
    if "Watch(" in text or "harness" in text:   # the grader's code, if it ever came this way
        text = text.replace("Watch(request.get(\\"banned\\", ())", "Watch((")
    return text.splitlines(keepends=True)

class NoWatch(ast.NodeTransformer):
    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "Watch":
            node.args = []
        return node

get_ipython().input_transformers_post.append(no_watch)
get_ipython().ast_transformers.append(NoWatch())

def causal_mask(tq, tk):
    return course_attn.causal_mask(tq, tk)
'''

CLEAR_THE_HITS = '''import gc
import sys
import course_attn

def causal_mask(tq, tk):
    answer = course_attn.causal_mask(tq, tk)
    for watch in gc.get_referents(sys.getprofile()):   # the watch behind its profiler
        if hasattr(watch, "hits"):
            watch.hits.clear()                         # forget the call just made
    return answer
'''

DISARM_THE_WATCH = '''import sys
import course_attn

def causal_mask(tq, tk):
    watch = sys.getprofile().__self__
    watch.armed = False
    return course_attn.causal_mask(tq, tk)
'''

SWITCH_THE_PROFILER_OFF = '''import sys
import course_attn

def causal_mask(tq, tk):
    sys.setprofile(None)
    return course_attn.causal_mask(tq, tk)
'''

SIBLING_OFFSETS = '''from course_attn.masks import query_key_offsets

def causal_mask(tq, tk):
    return query_key_offsets(tq, tk) >= 0
'''

SIBLING_BACKEND = '''from course_attn import backends

def masked_attention(q, k, v, mask):
    return backends.sdpa_attention(q, k, v, attn_mask=mask)
'''

READ_SOLUTIONS_NEXT_TO_THE_PACKAGE = '''import json
from pathlib import Path
import course_attn

SOLUTION = Path(course_attn.__file__).resolve().parents[1] / "solutions" / "03_masking.ipynb"

def causal_mask(tq, tk):
    cells = json.loads(SOLUTION.read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if "def causal_mask" in "".join(c["source"]))
    namespace = {"torch": torch}
    exec(source, namespace)
    return namespace["causal_mask"](tq, tk)
'''

FIND_SOLUTIONS_ON_THE_PATH = '''import os
import sys
from pathlib import Path

places = [*sys.path, os.getcwd(), os.environ.get("PWD", ""),
          *os.environ.get("PYTHONPATH", "").split(":")]
found = [Path(p) / "solutions" / "hidden" / "ch03.py" for p in places
         if p and (Path(p) / "solutions" / "hidden" / "ch03.py").exists()]
try:
    import solutions.hidden.ch03 as leaked
except ImportError:
    leaked = None

def causal_mask(tq, tk):
    if not found and leaked is None:
        raise FileNotFoundError("no solutions/ on the kernel's path")
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
'''

FUSED_ATTENTION = '''import torch.nn.functional as F

def masked_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
'''

TORCH_SOFTMAX = '''def stable_softmax(x, dim=-1):
    return torch.softmax(x, dim=dim)
'''

TENSOR_SOFTMAX = '''def stable_softmax(x, dim=-1):
    return x.softmax(dim)
'''

SOFTMAX_ITSELF = '''import functools

stable_softmax = functools.partial(torch.softmax)   # the banned function, as the answer
'''

# name -> (solution notebook, changes, attacked grade_id, its reason (a regex), extra flags)
ATTACKS = {
    "patched_comparisons_and_builtins": (
        CH03, {"replace": {"ch03-causal_mask-solution": PATCHED_COMPARISONS}},
        "ch03-causal_mask", r"\d+ of \d+ cases failed \(first, 'square, Tq=Tk=4': your result: "
                            r"6 of 16 entries differ; hint: .+\)", []),
    "reference_in_a_thread": (
        CH03, {"replace": {"ch03-causal_mask-solution": REFERENCE_IN_A_THREAD}},
        "ch03-causal_mask", re.escape(BANNED.format("course_attn.masks.causal_mask")), []),
    "reference_in_a_warm_thread_pool": (
        CH03, {"replace": {"ch03-causal_mask-solution": REFERENCE_IN_A_WARM_POOL}},
        "ch03-causal_mask", re.escape(BANNED.format("course_attn.masks.causal_mask")), []),
    "reference_in_a_raw_thread": (
        CH03, {"replace": {"ch03-causal_mask-solution": REFERENCE_IN_A_RAW_THREAD}},
        "ch03-causal_mask", re.escape(BANNED.format(
            "_thread.start_new_thread (a thread that the watch for banned calls cannot "
            "follow)")), []),
    "lookup_table_of_the_public_cases": (
        CH03, {"replace": {"ch03-causal_mask-solution": LOOKUP_TABLE}},
        "ch03-causal_mask", r"\d of \d+ cases failed \(first, a hidden case: your result: \d+ of "
                            r"\d+ entries differ\)", []),
    "input_transformer_forges_the_checks": (
        CH03, {"replace": {"ch03-causal_mask-solution": TRANSFORMER_FORGES_CHECKS}},
        "ch03-causal_mask", r"\d+ of \d+ cases failed \(first, 'square, Tq=Tk=4': .+", []),
    "transformers_rewrite_the_graders_code": (
        CH03, {"replace": {"ch03-causal_mask-solution": TRANSFORMERS_REWRITE_THE_GRADER}},
        "ch03-causal_mask", re.escape(BANNED.format("course_attn.masks.causal_mask")), []),
    "hits_cleared_after_the_call": (
        CH03, {"replace": {"ch03-causal_mask-solution": CLEAR_THE_HITS}},
        "ch03-causal_mask", re.escape(BANNED.format("course_attn.masks.causal_mask")), []),
    "watch_disarmed_before_the_call": (
        CH03, {"replace": {"ch03-causal_mask-solution": DISARM_THE_WATCH}},
        "ch03-causal_mask", re.escape(SWITCHED.format(
            "the profiler or the watch's own state, changed during the call")),
        ["ch03-causal_mask: the submission switched off the watch for banned calls (the "
         "profiler or the watch's own state, changed during the call)"]),
    "profiler_switched_off": (
        CH03, {"replace": {"ch03-causal_mask-solution": SWITCH_THE_PROFILER_OFF}},
        "ch03-causal_mask", re.escape(SWITCHED.format("sys.setprofile")),
        ["ch03-causal_mask: the submission switched off the watch for banned calls "
         "(sys.setprofile)"]),
    "sibling_query_key_offsets": (
        CH03, {"replace": {"ch03-causal_mask-solution": SIBLING_OFFSETS}},
        "ch03-causal_mask", re.escape(BANNED.format("course_attn.masks.query_key_offsets")), []),
    "sibling_sdpa_backend": (
        CH03, {"replace": {"ch03-masked_attention-solution": SIBLING_BACKEND}},
        "ch03-masked_attention", re.escape(BANNED.format("course_attn.backends.sdpa_attention")),
        []),
    "solutions_next_to_the_package": (
        CH03, {"replace": {"ch03-causal_mask-solution": READ_SOLUTIONS_NEXT_TO_THE_PACKAGE}},
        "ch03-causal_mask", r"\d+ of \d+ cases failed \(first, 'square, Tq=Tk=4': "
                            r"FileNotFoundError: \[Errno 2\] No such file or directory: "
                            r"'/[^']+/site/solutions/03_masking\.ipynb' .+", []),
    "solutions_on_the_kernels_path": (
        CH03, {"replace": {"ch03-causal_mask-solution": FIND_SOLUTIONS_ON_THE_PATH}},
        "ch03-causal_mask", r"\d+ of \d+ cases failed \(first, 'square, Tq=Tk=4': "
                            r"FileNotFoundError: no solutions/ on the kernel's path .+", []),
    "fused_attention": (
        CH03, {"replace": {"ch03-masked_attention-solution": FUSED_ATTENTION}},
        "ch03-masked_attention", re.escape(BANNED.format(
            "torch.nn.functional.scaled_dot_product_attention")), []),
    "torch_softmax": (
        CH02, {"replace": {"ch02-stable_softmax-solution": TORCH_SOFTMAX}},
        "ch02-stable_softmax", re.escape(BANNED.format("torch.softmax")), []),
    "tensor_softmax": (
        CH02, {"replace": {"ch02-stable_softmax-solution": TENSOR_SOFTMAX}},
        "ch02-stable_softmax", re.escape(BANNED.format("torch.Tensor.softmax")), []),
    "the_banned_function_as_the_answer": (
        CH02, {"replace": {"ch02-stable_softmax-solution": SOFTMAX_ITSELF}},
        "ch02-stable_softmax", re.escape(BANNED.format("torch.softmax")), []),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("attacks")
    paths = {name: write(edit(solution_notebook(source), **changes),
                         folder / f"{source.name[:3]}{name}.ipynb")
             for name, (source, changes, *_) in ATTACKS.items()}
    grades = grader.grade_notebooks(list(paths.values()), solutions_dir=SOLUTIONS, jobs=2)
    return dict(zip(paths, grades))


@pytest.mark.parametrize("name", ATTACKS)
def test_an_attack_scores_below_full_marks_with_a_reason_that_names_it(graded, name):
    grade, (_, _, gid, reason, flags) = graded[name], ATTACKS[name]
    assert grade.error is None and grade.total < grade.max_points
    attacked = {e.grade_id: e for e in grade.exercises}[gid]
    assert attacked.points == 0 and not attacked.passed
    assert re.fullmatch(reason, attacked.reason), attacked.reason
    if not flags:
        assert grade.flags == []
        return
    assert grade.flags[:len(flags)] == flags
    # an exercise whose solution calls the attacked function repeats its flag
    assert all(flag.split(": ", 1)[1] == flags[0].split(": ", 1)[1] for flag in
               grade.flags[len(flags):]), grade.flags


@pytest.mark.parametrize("name", ATTACKS)
def test_the_exercises_an_attack_does_not_touch_keep_their_points(graded, name):
    grade, (_, _, gid, _, _) = graded[name], ATTACKS[name]
    builds_on_it = {"ch03-causal_mask": {"ch03-document_mask"}}.get(gid, set())
    for exercise in grade.exercises:
        if exercise.grade_id != gid and exercise.grade_id not in builds_on_it:
            assert exercise.passed, (exercise.grade_id, exercise.reason)


# --- resource attacks: a kernel that dies, hangs or loops ----------------------------------------

TIME_LIMIT_S = 20
KILLS_ITS_KERNEL = "import os\n\nos.kill(os.getpid(), 9)\n"
HANGS_UNINTERRUPTIBLY = '''import time

while True:
    try:
        time.sleep(0.05)
    except BaseException:   # swallows the grader's interrupt
        pass
'''
LOOPS_AFTER_A_CORRECT_FUNCTION = '''def causal_mask(tq, tk):
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)

while True:   # a demo that never ends
    pass
'''

STOPPERS = {
    "kernel_killed_in_a_cell": {"replace": {"ch03-padding_mask-solution": KILLS_ITS_KERNEL}},
    "kernel_hangs_in_a_cell": {"replace": {"ch03-padding_mask-solution": HANGS_UNINTERRUPTIBLY}},
    "endless_loop_after_a_correct_function": {
        "replace": {"ch03-causal_mask-solution": LOOPS_AFTER_A_CORRECT_FUNCTION}},
}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stoppers")
    paths = {name: write(edit(solution_notebook(CH03), **changes), folder / f"03_{name}.ipynb")
             for name, changes in STOPPERS.items()}
    grades = grader.grade_notebooks(list(paths.values()), solutions_dir=SOLUTIONS,
                                    cell_timeout=TIME_LIMIT_S, jobs=2)
    return dict(zip(paths, grades))


@pytest.mark.parametrize("name, what", [
    ("kernel_killed_in_a_cell", r"the kernel died \(SIGKILL\)"),
    ("kernel_hangs_in_a_cell", rf"the kernel stopped answering after {TIME_LIMIT_S} s"),
])
def test_after_a_kernel_dies_or_hangs_the_later_exercises_keep_their_points(stopped, name,
                                                                              what):
    """The padding_mask cell (cell 8) kills or hangs the kernel: padding_mask scores 0, and
    the exercises after it, answered correctly, keep every point."""
    grade = stopped[name]
    scores = {e.grade_id: e for e in grade.exercises}
    assert scores["ch03-padding_mask"].points == 0
    assert re.match(r"(the kernel died \(SIGKILL\)|timed out after \d+ s) \(cell 8\)",
                    scores["ch03-padding_mask"].reason), scores["ch03-padding_mask"].reason
    others = [e for e in grade.exercises if e.grade_id != "ch03-padding_mask"]
    assert all(e.passed for e in others), [(e.grade_id, e.reason) for e in others]
    assert grade.total == grade.max_points - scores["ch03-padding_mask"].max_points
    assert len(grade.flags) == 1 and re.fullmatch(
        what + r" in cell 8; it was restarted, the cells before it were run again, and grading "
               r"went on after it", grade.flags[0]), grade.flags


def test_an_endless_loop_after_a_correct_function_is_interrupted_and_flagged(stopped):
    grade = stopped["endless_loop_after_a_correct_function"]
    assert grade.total == grade.max_points
    assert grade.flags == [f"cell 5 was interrupted after {TIME_LIMIT_S} s (time limit); "
                           "grading went on"]


# --- a process that outlives its kernel and would rewrite the report ---------------------------

MARKER = "escaped-from-grading-8237"
ESCAPE = '''import os
import sys
import textwrap
import time

def report_path():
    """The --json argument of the grader, from the command lines of this kernel's ancestors."""
    pid = os.getpid()
    while pid > 1:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        if b"--json" in args:
            return os.path.join(os.readlink(f"/proc/{pid}/cwd"),
                                args[args.index(b"--json") + 1].decode())
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])

PROGRAM = textwrap.dedent(f"""
    import os, time
    for _ in range(3):   # a new session, twice forked: no longer in the kernel's group
        if os.fork():
            os._exit(0)
        os.setsid()
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.05)
        try:
            if os.path.getsize({report_path()!r}) > 0:
                time.sleep(0.5)
                with open({report_path()!r}, "w") as report:
                    report.write("FORGED")
        except OSError:
            pass
""")
if os.fork() == 0:   # without the grader's mark in its environment
    os.execve(sys.executable, [sys.executable, "-c", PROGRAM, "MARKER"], {})
time.sleep(1)

def causal_mask(tq, tk):
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
'''.replace("MARKER", MARKER)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_process_in_a_new_session_is_killed_before_the_report_is_written(tmp_path, workers):
    notebook = write(edit(solution_notebook(CH03), replace={"ch03-causal_mask-solution": ESCAPE}),
                     tmp_path / "03_escape.ipynb")
    report = tmp_path / "report.json"
    result = run_grader(str(notebook), "--json", "report.json", "--workers", workers,
                        cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    time.sleep(2)  # what the escaped process would need to see the report and rewrite it
    assert live_processes(MARKER) == []
    [entry] = json.loads(report.read_text())["notebooks"]
    assert entry["total"] == entry["max"]
    assert by_grade_id(entry)["ch03-causal_mask"]["passed"]
    assert len(entry["flags"]) == 1 and re.fullmatch(
        r"\d+ process\(es\) that the submission left running were killed", entry["flags"][0])


CHAIN = '''
import os, sys, tempfile, time
from course_attn.grading import processes

processes.become_subreaper()
before = processes.children()
log = tempfile.mktemp()
if os.fork() == 0:
    os.setsid()
    for depth in range(40):   # a chain of 40 processes that all stay alive: MARKER
        if os.fork():
            break
    with open(log, "a") as file:
        file.write(f"{os.getpid()}\\n")
    if depth == 39:
        while True:   # and the last one keeps forking
            time.sleep(0.01)
            if os.fork() == 0:
                time.sleep(120)
                os._exit(0)
    time.sleep(120)
    os._exit(0)
deadline = time.time() + 60
while time.time() < deadline and (not os.path.exists(log) or
                                  len(open(log).read().split()) < 41):
    time.sleep(0.05)
print(processes.kill_new_children(before))
os.unlink(log)
'''.replace("MARKER", MARKER + "-chain")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_a_chain_of_processes_that_keeps_forking_is_killed_whole():
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHAIN)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 41
    time.sleep(0.5)
    assert live_processes(MARKER + "-chain") == []
