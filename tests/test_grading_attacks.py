"""Every attack of issues 8 and 18 on the real chapters: a wrong, copied or borrowed answer
scores nothing, with a reason that names the attack; what one submission does costs nobody else
a point.

Issue 8 (before the grade moved out of the student's process): patching the comparison or a
builtin, calling the reference from a thread, answering the public cases from a table, input
transformers that forge the checks, clearing or disarming the watch for banned calls, a sibling
function of the package, reading ``solutions/`` next to the package, a process that rewrote the
report after the grader wrote it; a kernel that died or hung cost every later exercise.

Issue 18 (the kernel now runs in a bubblewrap sandbox, and a guard made of torch modes checks
every operation a graded function runs, ``harness.Guard``): a tensor subclass that turns into
the reference when the harness reads it; a blank notebook that reads the solutions through
``/proc/<ppid>/cwd``; the routes around a ban by name (``torch.ops.aten.*``, private and C-level
aliases, ``map``, a thread, a decoy of the banned function, ``course_attn.__path__ = []``, the
guard reached through the stack); and, in a class graded with two workers next to honest
classmates whose full marks must stand, patching the grader's files, killing or stopping its
processes, forging hits, a ``.pth`` in site-packages, a memory bomb of forked children, a flood
of output, reading the grader's memory.

Each submission is a solution notebook (``solutions/NN_*.ipynb``) with some exercises' answers
replaced by attacks; one notebook holds at most one attack per exercise, so that the notebooks
of one module-scoped call stay few (kernels start in about 5 s each). The attacked exercise must
score 0 with the reason given here; the others keep their points (unless they build on the
attacked function, as ch03.document_mask builds on causal_mask). Where the grader does not
refuse an attack yet, the test is ``xfail(strict=True)`` with the gap in its reason.
"""

import json
import re
import subprocess
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

from grading_support import (  # noqa: E402
    ROOT, SOLUTIONS, by_grade_id, copy_course, edit, exercise_of, live_processes,
    require_sandbox, run_grader, run_grader_in, solution_notebook, solution_ids, write,
)

from course_attn.grading import grader  # noqa: E402

NOTEBOOKS = {"ch02": SOLUTIONS / "02_scaled_dot_product.ipynb",
             "ch03": SOLUTIONS / "03_masking.ipynb", "ch06": SOLUTIONS / "06_qk_norm.ipynb",
             "ch07": SOLUTIONS / "07_mqa_gqa.ipynb",
             "ch09": SOLUTIONS / "09_flash_attention.ipynb",
             "ch10": SOLUTIONS / "10_linear_attention.ipynb"}
CH02, CH03 = NOTEBOOKS["ch02"], NOTEBOOKS["ch03"]
BANNED = "calls {}, which this exercise does not allow: write the computation yourself"
SWITCHED = (re.escape("switches off the check of the operations it runs (") + ".+" +
            re.escape("), which no exercise allows"))


def banned(name: str) -> str:
    return re.escape(BANNED.format(name))


def review(why: str) -> str:
    """The review flag (no points lost) that names the cells with a sign of ``why``."""
    return r"for review \(no points lost\): (cell \d+, )*cell \d+ " + re.escape(why)


STACK = review("walks the call stack (sys._getframe, inspect.stack, f_back)")
C_CORE = review("reaches the module table or torch's C core (sys.modules, torch._C, dispatch "
                "keys)")
RUN_TIME_CODE = review("runs code built at run time (exec, eval, compile, __import__, importlib)")
PROCESSES = review("starts another process (multiprocessing, subprocess, os.fork, os.system)")
DUNDERS = review("reads Python's internals through a dunder attribute (__globals__, __closure__, "
                 "__dict__)")
DISPATCH = review("hooks into torch's dispatch (__torch_function__, torch modes)")
GRADER_PACKAGE = review("imports or reaches the grader's package (course_attn.grading)")
MACHINERY = review("replaces the kernel's own machinery (IPython's user_expressions, execution, "
                   "replies)")
RAW_THREADS = review("starts a thread that no check follows (_thread)")
PROC = review("reads /proc")
OBJECTS = review("rewrites or searches Python's own objects (builtins, code objects, "
                 "__subclasses__)")
SIGNALS = review("sends signals (os.kill)")


def switched_flag(gid: str) -> str:
    return re.escape(f"{gid}: the submission switched off the check of the operations it "
                     "runs (") + r".+\)"


# --- the attacks: each replaces one exercise's solution (or follows it, ``how="after"``) --------

PATCHED_COMPARISONS = '''import torch
import torch.testing
import course_attn.grading.cases as cases
import course_attn.grading.judge as judge

# (a patched builtin, sorted() of the old tamper check, now breaks torch's own lazy imports
# under the guard: the kernel fails every exercise, and the attacker only hurts itself)
cases.expect_tensor = lambda *args, **kwargs: None    # the comparison, in the kernel
judge.judge_case = lambda *args, **kwargs: judge.CaseResult("all", True)
torch.testing.assert_close = lambda *args, **kwargs: None
torch.equal = lambda *args, **kwargs: True
torch.Tensor.__ne__ = lambda self, other: torch.zeros_like(self, dtype=torch.bool)

def causal_mask(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool)       # wrong
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

def no_guard(lines):
    text = "".join(lines)
    if "Guard(" in text or "harness" in text:   # the grader's code, if it ever came this way
        text = text.replace("Guard(request.get(\\"ops\\")", "Guard(None")
    return text.splitlines(keepends=True)

class NoGuard(ast.NodeTransformer):
    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "Guard":
            node.args = []
        return node

get_ipython().input_transformers_post.append(no_guard)
get_ipython().ast_transformers.append(NoGuard())

def causal_mask(tq, tk):
    return course_attn.causal_mask(tq, tk)
'''

SIBLING_OFFSETS = '''from course_attn.masks import query_key_offsets

def causal_mask(tq, tk):
    return query_key_offsets(tq, tk) >= 0
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
          *os.environ.get("PYTHONPATH", "").split(":"), "REPOSITORY"]
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
'''.replace("REPOSITORY", str(ROOT))

PACKAGE_PATH_EMPTIED = '''import course_attn
import course_attn.masks

course_attn.__path__ = []   # the package no longer looks like one

def causal_mask(tq, tk):
    return course_attn.masks.causal_mask(tq, tk)
'''

REFERENCE_IN_A_THREAD = '''import threading
import course_attn

def padding_mask(lengths, t):
    out = []
    helper = threading.Thread(target=lambda: out.append(course_attn.padding_mask(lengths, t)))
    helper.start()
    helper.join()
    return out[0]
'''

REFERENCE_IN_A_WARM_POOL = '''from concurrent.futures import ThreadPoolExecutor
import course_attn

pool = ThreadPoolExecutor(max_workers=1)
pool.submit(lambda: None).result()   # its thread runs from now on, before any grading

def padding_mask(lengths, t):
    return pool.submit(course_attn.padding_mask, lengths, t).result()
'''

REFERENCE_IN_A_RAW_THREAD = '''import _thread
import time
import course_attn

def padding_mask(lengths, t):
    out = []
    _thread.start_new_thread(lambda: out.append(course_attn.padding_mask(lengths, t)), ())
    while not out:
        time.sleep(0.001)
    return out[0]
'''

HITS_CLEARED_AFTER_THE_CALL = '''import torch.overrides
import course_attn

def padding_mask(lengths, t):
    answer = course_attn.padding_mask(lengths, t)
    for mode in torch.overrides._get_current_function_mode_stack():
        if hasattr(mode, "guard"):
            mode.guard.hits.clear()                # forget the call just made
    return answer
'''

GUARD_DISARMED = '''import torch.overrides
import course_attn

def padding_mask(lengths, t):
    for mode in torch.overrides._get_current_function_mode_stack():
        if hasattr(mode, "guard"):
            mode.guard.armed = False
    return course_attn.padding_mask(lengths, t)
'''

MODES_POPPED = '''import course_attn

def padding_mask(lengths, t):
    torch._C._pop_torch_function_stack()
    torch._C._pop_torch_dispatch_stack()
    return course_attn.padding_mask(lengths, t)
'''

SUBCLASS_TURNS_INTO_THE_REFERENCE = '''import course_attn

class Answer(torch.Tensor):
    """Zeros that become the reference whenever torch reads them (to send them back, say)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], Answer) and hasattr(args[0], "question"):
            args = (course_attn.padding_mask(*args[0].question), *args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

def padding_mask(lengths, t):
    answer = torch.zeros(len(lengths), 1, 1, t, dtype=torch.bool).as_subclass(Answer)
    answer.question = (lengths, t)
    return answer
'''

SIBLING_BACKEND = '''from course_attn import backends

def masked_attention(q, k, v, mask):
    return backends.sdpa_attention(q, k, v, attn_mask=mask)
'''

FUSED_ATTENTION = '''import torch.nn.functional as F

def masked_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
'''

ATEN_SDPA = '''def masked_attention(q, k, v, mask):
    out = torch.ops.aten.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return torch.nan_to_num(out)                     # dead rows: NaN -> 0
'''

SDPA_MATH = '''def masked_attention(q, k, v, mask):
    out, _ = torch._scaled_dot_product_attention_math(q, k, v, attn_mask=mask)
    return torch.nan_to_num(out)
'''

DECOY_SDPA = '''import torch.nn.functional as F

_saved = F.scaled_dot_product_attention

def _decoy(q, k, v, attn_mask=None, **kwargs):         # a Python function in its place
    return torch.nan_to_num(_saved(q, k, v, attn_mask=attn_mask, **kwargs))

F.scaled_dot_product_attention = _decoy

def masked_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
'''

FP16_SUBSTRING = '''_right = fp16_fill

def fp16_fill(*args, **kwargs):
    """The right predictions, but "no error: ..." where masked_fill raises."""
    answer = dict(_right(*args, **kwargs))
    return {key: "no error: masked_fill just writes -inf" if value == "error" else value
            for key, value in answer.items()}
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

ATEN_SOFTMAX = '''def stable_softmax(x, dim=-1):
    return torch.ops.aten._softmax(x, dim, False)
'''

PRIVATE_SOFTMAX = '''def stable_softmax(x, dim=-1):
    return torch._softmax(x, dim, False)
'''

SOFTMAX_IN_A_MAP = '''import itertools

def stable_softmax(x, dim=-1):
    rows = x.movedim(dim, -1)
    flat = rows.reshape(-1, rows.shape[-1])
    out = torch.stack(list(map(torch.softmax, flat, itertools.repeat(-1))))   # C calls C
    return out.reshape(rows.shape).movedim(-1, dim)
'''

HITS_CLEARED_THROUGH_THE_STACK = '''import sys

def stable_softmax(x, dim=-1):
    answer = torch.softmax(x, dim=dim)
    frame = sys._getframe(1)
    while frame is not None:                         # up to the guard's own frames
        guard = frame.f_locals.get("self")
        if hasattr(guard, "hits") and hasattr(guard, "armed"):
            guard.hits.clear()
        frame = frame.f_back
    return answer
'''

# issue 30: routes around the guard that no check in the kernel can close, each refused or
# flagged for review
SAFE_SOFTMAX_UNDER_AN_EXCLUDED_KEY = '''def stable_softmax(x, dim=-1):
    hidden = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)   # no torch mode sees it
    with torch._C._ExcludeDispatchKeyGuard(hidden):
        return torch.ops.aten._safe_softmax(x, dim)
'''

RESULT_KEPT_UNDER_AN_EXCLUDED_KEY = '''KEPT = []

def stable_softmax(x, dim=-1):
    hidden = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)   # no torch mode sees it
    with torch._C.DisableTorchFunction(), torch._C._ExcludeDispatchKeyGuard(hidden):
        out = torch.ops.aten._safe_softmax(x, dim)
    KEPT.append(out)   # held here too, so that it passes for a tensor cached before the call
    return out
'''

A_NESTED_NAMESPACE_FED_THROUGH_PIPES = '''import subprocess
import sys

# the first process of a user and PID namespace of its own, as bubblewrap's init is of the
# sandbox's: a rule that spares "process 1 of its namespace" would spare it too
CHILD = subprocess.Popen(
    ["unshare", "--user", "--pid", "--fork", sys.executable, "-c",
     "import json, sys, torch\\nfor line in sys.stdin:\\n"
     "    print(json.dumps(torch.softmax(torch.tensor(json.loads(line)), -1).tolist()), "
     "flush=True)"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
'''

SOFTMAX_THROUGH_EXEC = '''exec("def stable_softmax(x, dim=-1):\\n    return torch.softmax(x, dim=dim)\\n")
'''

HARNESS_SOUGHT_IN_SYS_MODULES = '''import sys

def stable_softmax(x, dim=-1):
    for name, module in list(sys.modules.items()):     # the harness, if it were there
        for value in list(vars(module).values()) if name.startswith("course_attn_h") else ():
            if hasattr(value, "hits") and hasattr(value, "armed"):
                value.armed = False
    return torch.softmax(x, dim=dim)
'''

GUARD_SOUGHT_THROUGH_FRAMES_BY_A_COMPUTED_NAME = '''import sys

_frames = getattr(sys, "_get" + "frame")            # no "_getframe" for a scan to read

def stable_softmax(x, dim=-1):
    frame = _frames(1)
    while frame is not None:                         # up to the guard's frames, if any
        for value in list(frame.f_locals.values()):
            if hasattr(value, "refused"):
                value.refused = frozenset()          # its settings emptied
        frame = frame.f_back
    return torch.softmax(x, dim=dim)
'''

HARNESS_REACHED_THROUGH_ITS_CLOSURE = '''def _silent():
    hits_fd = None
    def report(name):                                   # one free variable, as the harness's
        return hits_fd
    return report

def stable_softmax(x, dim=-1):
    for cls in ().__class__.__base__.__subclasses__():
        if cls.__name__.startswith("CourseAttnHarness"):
            for cell in cls.evaluate.__closure__ or ():   # the harness's report() and namespace
                value = cell.cell_contents
                if callable(value) and value.__name__ == "report":
                    value.__code__ = _silent().__code__   # the guard's hits go nowhere
    return torch.softmax(x, dim=dim)
'''

PREDICTION_COMPUTED = '''def fp16_fill(dtype, fill, scores):
    """The reference's code, run rather than predicted."""
    kind = {"float16": torch.float16, "float32": torch.float32}[dtype]
    s = torch.tensor(scores).to(kind)
    cast = torch.tensor(fill).to(kind)
    allowed = torch.arange(len(scores)) % 2 == 0
    try:
        s.masked_fill(~allowed, fill)
        masked = "fills"
    except RuntimeError:
        masked = "error"
    return {"cast": cast.item(), "masked_fill": masked,
            "dead_row": torch.softmax(s + cast, dim=-1).tolist()}
'''

A_CHILD_FED_THROUGH_PIPES = '''import subprocess
import sys

# started before any graded call, so no guard is in it: it reads rows, writes their softmax
CHILD = subprocess.Popen(
    [sys.executable, "-c", "import json, sys, torch\\nfor line in sys.stdin:\\n"
     "    print(json.dumps(torch.softmax(torch.tensor(json.loads(line)), -1).tolist()), "
     "flush=True)"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
'''

SOFTMAX_IN_A_CHILD_STARTED_BEFORE = '''import json

def stable_softmax(x, dim=-1):
    CHILD.stdin.write(json.dumps(x.movedim(dim, -1).tolist()) + "\\n")
    CHILD.stdin.flush()
    rows = json.loads(CHILD.stdout.readline())
    return torch.tensor(rows, dtype=x.dtype).movedim(-1, dim)
'''

SOFTMAX_BACKWARD_DATA = '''def softmax_backward(y, g, dim=-1):
    return torch.ops.aten._softmax_backward_data(g, y, dim, y.dtype)
'''

LOG_SOFTMAX_EXP = '''def online_softmax(x):
    return torch.special.log_softmax(x, -1).exp()
'''

SOFTMAX_IN_A_THREAD = '''import threading

def online_softmax(x):
    out = []
    worker = threading.Thread(target=lambda: out.append(torch.softmax(x, dim=-1)))
    worker.start()
    worker.join()
    return out[0]
'''

LOGCUMSUMEXP = '''def merge_states(out_a, lse_a, out_b, lse_b):
    lse = torch.logcumsumexp(torch.stack([lse_a, lse_b]), dim=0)[-1]   # log(e^a + e^b)
    w_a = torch.nan_to_num(torch.exp(lse_a - lse))[..., None]
    w_b = torch.nan_to_num(torch.exp(lse_b - lse))[..., None]
    return (w_a * out_a + w_b * out_b).to(out_a.dtype), lse
'''

BLOCK_MASK = '''from torch.nn.attention.flex_attention import create_block_mask

def tile_mask(tq, tk, block_q, block_k, is_causal=False, window=None):
    def allowed(b, h, q, k):
        d = q + (tk - tq) - k                        # how far key k lies before query q
        ok = d >= 0 if is_causal else d == d
        if window is not None:
            ok = ok & ((d < window) if is_causal else (d.abs() < window))
        return ok
    mask = create_block_mask(allowed, None, None, tq, tk, device="cpu",
                             BLOCK_SIZE=(block_q, block_k))
    return mask.to_dense()[0, 0].bool()[: -(-tq // block_q), : -(-tk // block_k)]
'''

ATEN_RMS_NORM = '''def rms_norm(x, weight=None, eps=1e-6):
    return torch.ops.aten.rms_norm(x, [x.shape[-1]], weight, eps)
'''

ATEN_REPEAT_INTERLEAVE = '''def repeat_kv(x, n_rep):
    return torch.ops.aten.repeat_interleave(x, n_rep, 1)
'''

FLEX_ATTENTION = '''from torch.nn.attention.flex_attention import flex_attention

def gqa_attention(q, k, v, is_causal=False):
    tq, tk = q.shape[-2], k.shape[-2]

    def causal(score, b, h, qi, ki):
        return torch.where(ki <= qi + (tk - tq), score, -float("inf"))
    return flex_attention(q, k, v, score_mod=causal if is_causal else None, enable_gqa=True)
'''

ANSWER_FORGED_IN_THE_REPLY = '''import ast
import base64
import json
import course_attn

_asked = []   # the grader's inputs, as the graded function saw them

def rms_norm(*args, **kwargs):
    _asked.append((args, kwargs))
    return torch.zeros_like(args[0])                 # nothing banned, and nothing right

def _encode(tensor):
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"__tensor__": {"dtype": str(tensor.dtype).removeprefix("torch."),
                           "shape": list(tensor.shape), "device": "cpu",
                           "data": base64.b64encode(raw).decode()}}

_user_expressions = get_ipython().user_expressions

def user_expressions(expressions):
    """The grader's expression, then its answer rewritten with the reference's outputs."""
    _asked.clear()
    replies = _user_expressions(expressions)
    for reply in replies.values():
        data = reply.get("data") or {}
        try:
            answer = json.loads(ast.literal_eval(data["text/plain"]))
        except Exception:
            continue
        if len(answer.get("results", ())) == len(_asked):
            answer["results"] = [{"value": _encode(course_attn.rms_norm(*args, **kwargs))}
                                 for args, kwargs in _asked]
            answer["banned"] = []
            data["text/plain"] = repr(json.dumps(answer))
    return replies

get_ipython().user_expressions = user_expressions
'''

CELU = '''def elu_feature_map(x):
    return torch.celu(x) + 1                         # celu with alpha 1 is elu
'''

C_NN_ELU = '''def elu_feature_map(x):
    return torch._C._nn.elu(x) + 1
'''


@dataclass(frozen=True)
class Attack:
    """``what``: the attack of issue 8 or 18 it is. ``submission``: the notebook it is in (one
    attack per exercise in a notebook). ``reason``: a regex for the attacked exercise's reason;
    ``flags``: regexes, each matching one of the notebook's flags. ``gap``: why the grader
    does not refuse it yet (the test is xfail, strict)."""

    what: str
    submission: str
    gid: str
    code: str
    reason: str
    flags: tuple[str, ...] = ()
    how: str = "replace"
    gap: str | None = None
    before: str = ""  # code of a cell put right after the setup cell, before any graded call


FAILS = r"\d+ of \d+ cases failed \(first, "


def fails_first_or_named(first: str) -> str:
    """The reason shows the first failed case (``first``: the rest of the reason), or, where a
    failed case's answer is a typical mistake's, that one (hidden cases differ by seed)."""
    return r"\d+ of \d+ cases failed \((?:first, " + first + r"|one that names the mistake, .+\))"


ATTACKS = {
    # issue 8: a wrong answer that patches what the grader compared with, in the kernel
    "patched_comparisons_and_builtins": Attack(
        "issue 8: patched comparisons, builtins and the grader's judge in the kernel",
        "03_patched", "ch03-causal_mask", PATCHED_COMPARISONS,
        fails_first_or_named(r"'square, Tq=Tk=4': your result: 6 of 16 entries differ"
                             r"(?:; hint: .+)?\)"),
        (GRADER_PACKAGE, DUNDERS)),
    "lookup_table_of_the_public_cases": Attack(
        "issue 8: the public cases answered from a table recorded before grading",
        "03_a", "ch03-causal_mask", LOOKUP_TABLE,
        fails_first_or_named(r"a hidden case(?: \(.+?\))?: your result: \d+ of \d+ entries "
                             r"differ\)")),
    "input_transformer_forges_the_checks": Attack(
        "issue 8: an input transformer that prints a pass for every check cell",
        "03_b", "ch03-causal_mask", TRANSFORMER_FORGES_CHECKS,
        fails_first_or_named(r"'square, Tq=Tk=4': .+"), (MACHINERY,)),  # issue 41: now read
    "transformers_rewrite_the_graders_code": Attack(
        "issue 8: input and AST transformers that would rewrite the grader's code",
        "03_c", "ch03-causal_mask", TRANSFORMERS_REWRITE_THE_GRADER,
        banned("course_attn.masks.causal_mask"), (MACHINERY,)),  # issue 41: now read
    "sibling_query_key_offsets": Attack(
        "issue 8: a sibling function of the package", "03_d", "ch03-causal_mask",
        SIBLING_OFFSETS, banned("course_attn.masks.query_key_offsets")),
    "solutions_next_to_the_package": Attack(
        "issue 8: solutions/ read next to the package the kernel imports",
        "03_e", "ch03-causal_mask", READ_SOLUTIONS_NEXT_TO_THE_PACKAGE,
        FAILS + r"'square, Tq=Tk=4': FileNotFoundError: \[Errno 2\] No such file or "
                r"directory: '/[^']+/site/solutions/03_masking\.ipynb' .+", (RUN_TIME_CODE,)),
    "solutions_on_the_kernels_path": Attack(
        "issue 8: solutions/ looked for on the kernel's path, its folders and the repository's",
        "03_f", "ch03-causal_mask", FIND_SOLUTIONS_ON_THE_PATH,
        FAILS + r"'square, Tq=Tk=4': FileNotFoundError: no solutions/ on the kernel's path .+"),
    "package_path_emptied": Attack(
        "issue 18: course_attn.__path__ = [] and then course_attn.masks.causal_mask",
        "03_g", "ch03-causal_mask", PACKAGE_PATH_EMPTIED, banned("course_attn.masks.causal_mask"),
        (DUNDERS,)),
    # the reference, called where the guard might not look
    "reference_in_a_thread": Attack(
        "issue 8: the reference called from a threading.Thread", "03_a", "ch03-padding_mask",
        REFERENCE_IN_A_THREAD, banned("course_attn.masks.padding_mask")),
    "reference_in_a_warm_thread_pool": Attack(
        "issue 8: the reference called in a pool thread started before grading",
        "03_b", "ch03-padding_mask", REFERENCE_IN_A_WARM_POOL,
        banned("course_attn.masks.padding_mask")),
    "hits_cleared_after_the_call": Attack(
        "issue 8/18: the guard found through torch's mode stack, its hits cleared after the call",
        "03_d", "ch03-padding_mask", HITS_CLEARED_AFTER_THE_CALL,
        banned("course_attn.masks.padding_mask"), (DISPATCH,)),
    "guard_disarmed_before_the_call": Attack(
        "issue 8/18: the guard found through torch's mode stack and disarmed (armed = False)",
        "03_e", "ch03-padding_mask", GUARD_DISARMED, SWITCHED,
        (switched_flag("ch03-padding_mask"), DISPATCH)),
    "guard_modes_popped": Attack(
        "issue 8/18 (was: the profiler switched off): torch's mode stacks popped in the call",
        "03_f", "ch03-padding_mask", MODES_POPPED, SWITCHED,
        (switched_flag("ch03-padding_mask"), DISPATCH, C_CORE)),
    "subclass_turns_into_the_reference": Attack(
        "issue 18, 1: a Tensor subclass whose __torch_function__ gives the reference when the "
        "harness reads it", "03_g", "ch03-padding_mask", SUBCLASS_TURNS_INTO_THE_REFERENCE,
        FAILS + r"'[^']+': your function returned a value of type Answer, which is not a "
                r"tensor, number, string or list of them\)", (DISPATCH, C_CORE)),
    # ch03.masked_attention: attention kernels
    "sibling_sdpa_backend": Attack(
        "issue 8: the package's SDPA backend", "03_a", "ch03-masked_attention",
        SIBLING_BACKEND, banned("course_attn.sdpa.sdpa_attention")),
    "fused_attention": Attack(
        "issue 8: F.scaled_dot_product_attention", "03_b", "ch03-masked_attention",
        FUSED_ATTENTION, banned("torch.nn.functional.scaled_dot_product_attention")),
    "aten_scaled_dot_product_attention": Attack(
        "issue 18: torch.ops.aten.scaled_dot_product_attention", "03_c", "ch03-masked_attention",
        ATEN_SDPA, banned("torch.ops.aten.scaled_dot_product_attention")),
    "scaled_dot_product_attention_math": Attack(
        "issue 18: torch._scaled_dot_product_attention_math", "03_d", "ch03-masked_attention",
        SDPA_MATH, banned("torch._scaled_dot_product_attention_math")),
    "decoy_of_the_fused_attention": Attack(
        "issue 18: a decoy bound to F.scaled_dot_product_attention hiding calls to the saved "
        "original", "03_e", "ch03-masked_attention", DECOY_SDPA,
        banned("torch.nn.functional.scaled_dot_product_attention")),
    # ch03.fp16_fill: a prediction
    "fp16_fill_error_as_a_substring": Attack(
        "issue 18, 4: ch03.fp16_fill answered 'no error: masked_fill just writes -inf'",
        "03_a", "ch03-fp16_fill", FP16_SUBSTRING,
        fails_first_or_named(
            r"'\(b\) s\.masked_fill\(~allowed, fill\) \(dtype=float16, [^']+\)': your "
            r"'masked_fill' is not one of the options 'error', 'fills': got 'no error: "
            r"masked_fill just writes -inf'\)"), how="after"),
    # ch02: the softmax family, refused by ch02.stable_softmax's allowlist and names
    "torch_softmax": Attack(
        "issue 8: torch.softmax", "02_a", "ch02-stable_softmax", TORCH_SOFTMAX,
        banned("torch.softmax")),
    "tensor_softmax": Attack(
        "issue 8: Tensor.softmax", "02_b", "ch02-stable_softmax", TENSOR_SOFTMAX,
        banned("torch.Tensor.softmax")),
    "the_banned_function_as_the_answer": Attack(
        "issue 8: functools.partial(torch.softmax) as the answer", "02_c", "ch02-stable_softmax",
        SOFTMAX_ITSELF, banned("torch.softmax")),
    "aten_softmax": Attack(
        "issue 18: torch.ops.aten._softmax", "02_d", "ch02-stable_softmax", ATEN_SOFTMAX,
        banned("torch.ops.aten._softmax")),
    "private_softmax": Attack(
        "issue 18: torch._softmax", "02_e", "ch02-stable_softmax", PRIVATE_SOFTMAX,
        banned("torch._softmax")),
    "hits_cleared_through_the_stack": Attack(
        "issue 18: the guard reached through sys._getframe, its hits cleared after torch.softmax",
        "02_f", "ch02-stable_softmax", HITS_CLEARED_THROUGH_THE_STACK, banned("torch.softmax"),
        (STACK,)),
    "softmax_in_a_map": Attack(
        "issue 18: map(torch.softmax, rows)", "02_g", "ch02-stable_softmax", SOFTMAX_IN_A_MAP,
        banned("torch.softmax")),
    "safe_softmax_under_an_excluded_dispatch_key": Attack(
        "issue 30: torch.ops.aten._safe_softmax inside torch._C._ExcludeDispatchKeyGuard of the "
        "Python key (no mode sees it: a tensor made where the guard saw no operation)", "02_h",
        "ch02-stable_softmax", SAFE_SOFTMAX_UNDER_AN_EXCLUDED_KEY, SWITCHED,
        (switched_flag("ch02-stable_softmax"), C_CORE)),
    "result_kept_under_an_excluded_dispatch_key": Attack(
        "issue 41: torch.ops.aten._safe_softmax with torch's function hook off and the Python "
        "key excluded, the result also kept in a global list (it passed for a cache): a tensor "
        "made during the call while the guard saw no operation scores 0, whoever holds it",
        "02_n", "ch02-stable_softmax", RESULT_KEPT_UNDER_AN_EXCLUDED_KEY, SWITCHED,
        (switched_flag("ch02-stable_softmax"), C_CORE, DISPATCH)),
    "softmax_in_a_nested_namespace_started_before": Attack(
        "issue 41: torch.softmax in a child started before the graded calls as the first process "
        "of a nested user and PID namespace: the sandbox makes no namespace (--disable-userns) "
        "and the grader ends every process but bubblewrap's init and the kernel, known by the "
        "pids recorded at start, so the function writes to a pipe nobody reads", "02_o",
        "ch02-stable_softmax", SOFTMAX_IN_A_CHILD_STARTED_BEFORE,
        FAILS + r".*BrokenPipeError.*", (PROCESSES,), before=A_NESTED_NAMESPACE_FED_THROUGH_PIPES),
    "softmax_through_exec": Attack(
        "issue 30: the answer defined inside exec of a string", "02_i", "ch02-stable_softmax",
        SOFTMAX_THROUGH_EXEC, banned("torch.softmax"), (RUN_TIME_CODE,)),
    "harness_sought_in_sys_modules": Attack(
        "issue 30: the harness looked for in sys.modules, to disarm its guard", "02_j",
        "ch02-stable_softmax", HARNESS_SOUGHT_IN_SYS_MODULES, banned("torch.softmax"), (C_CORE,)),
    "guard_sought_through_frames_by_a_computed_name": Attack(
        "issue 30: the guard's settings emptied through frames found with getattr(sys, '_get' + "
        "'frame')", "02_l", "ch02-stable_softmax", GUARD_SOUGHT_THROUGH_FRAMES_BY_A_COMPUTED_NAME,
        banned("torch.softmax (it runs aten._softmax)"), (STACK,)),  # the name, folded
    "harness_reached_through_its_closure": Attack(
        "issue 30: the harness's report() replaced through its class's __closure__, so that no "
        "hit reaches the grader", "02_m", "ch02-stable_softmax",
        HARNESS_REACHED_THROUGH_ITS_CLOSURE, banned("torch.softmax"),  # from the answer's record
        (DUNDERS, OBJECTS, GRADER_PACKAGE)),  # issue 41: "CourseAttnHarness" in a string too
    "prediction_computed": Attack(
        "issue 30: ch03.fp16_fill computed with the reference's torch code, not predicted",
        "03_d", "ch03-fp16_fill", PREDICTION_COMPUTED, banned("torch.tensor")),
    "softmax_in_a_child_started_before": Attack(
        "issue 30: torch.softmax in a python -c child started before the graded calls and fed "
        "through pipes (no guard in that process): the grader ends it before the first graded "
        "call, so the function writes to a pipe nobody reads", "02_k", "ch02-stable_softmax",
        SOFTMAX_IN_A_CHILD_STARTED_BEFORE, FAILS + r".*BrokenPipeError.*", (PROCESSES,),
        before=A_CHILD_FED_THROUGH_PIPES),
    "reference_in_a_raw_thread": Attack(
        "issue 8/18: the reference called from a thread that _thread started (no mode there; "
        "since issue 30 the answer, a tensor made while the guard saw no operation, scores 0)",
        "03_c", "ch03-padding_mask", REFERENCE_IN_A_RAW_THREAD, SWITCHED,
        (RAW_THREADS, switched_flag("ch03-padding_mask"))),
    "aten_softmax_backward_data": Attack(
        "issue 18: torch.ops.aten._softmax_backward_data (refused by name in "
        "ch02.softmax_backward)", "02_a", "ch02-softmax_backward", SOFTMAX_BACKWARD_DATA,
        banned("torch.ops.aten._softmax_backward_data")),
    # ch09: softmax without softmax, logsumexp without logsumexp
    "log_softmax_then_exp": Attack(
        "issue 18: torch.special.log_softmax(...).exp()", "09_a", "ch09-online_softmax",
        LOG_SOFTMAX_EXP, banned("torch.special.log_softmax")),
    "softmax_in_a_thread": Attack(
        "issue 18: torch.softmax computed in a threading.Thread", "09_b", "ch09-online_softmax",
        SOFTMAX_IN_A_THREAD, banned("torch.softmax")),
    "logcumsumexp": Attack(
        "issue 18: torch.logcumsumexp", "09_a", "ch09-merge_states", LOGCUMSUMEXP,
        banned("torch.logcumsumexp (it runs aten.logcumsumexp)")),
    "create_block_mask": Attack(
        "issue 18: flex attention's create_block_mask(...).to_dense() for ch09.tile_mask",
        "09_a", "ch09-tile_mask", BLOCK_MASK,
        banned("torch.nn.attention.flex_attention.create_block_mask")),
    # ch06, ch07, ch10: composites that torch decomposes into allowed operations
    "aten_rms_norm": Attack(
        "issue 18: torch.ops.aten.rms_norm", "06_a", "ch06-rms_norm", ATEN_RMS_NORM,
        banned("torch.ops.aten.rms_norm")),
    "answer_forged_in_the_reply": Attack(
        "issue 18 (found while writing these tests): the graded function records the grader's "
        "inputs and returns zeros; an override of get_ipython().user_expressions rewrites the "
        "answer in the Jupyter reply with the reference's outputs, computed after the guard: "
        "the grader reads the answer the harness wrote on its pipe, not the reply, so the "
        "zeros are graded (and the override flagged)",
        "06_b", "ch06-rms_norm", ANSWER_FORGED_IN_THE_REPLY,
        FAILS + r".*your result differs from the expected one.*", (MACHINERY,)),
    "aten_repeat_interleave": Attack(
        "issue 18: torch.ops.aten.repeat_interleave", "07_a", "ch07-repeat_kv",
        ATEN_REPEAT_INTERLEAVE, banned("torch.ops.aten.repeat_interleave")),
    "flex_attention": Attack(
        "issue 18: flex_attention for ch07.gqa_attention", "07_a", "ch07-gqa_attention",
        FLEX_ATTENTION, banned("torch.nn.attention.flex_attention.flex_attention")),
    "celu": Attack(
        "issue 18: torch.celu (elu with alpha 1)", "10_a", "ch10-elu_feature_map", CELU,
        banned("torch.celu")),
    "c_level_elu": Attack(
        "issue 18: torch._C._nn.elu", "10_b", "ch10-elu_feature_map", C_NN_ELU,
        banned("torch.nn.functional.elu"), (C_CORE,)),
}

# Not refused, by design: left to a human reviewer (harness.Guard's docstring: a thread that
# _thread started runs without the guard's modes).

# which exercises call the one attacked, in the solution notebooks
BUILDS_ON = {"ch03-causal_mask": {"ch03-document_mask"}, "ch02-stable_softmax": {"ch02-attention"},
             "ch06-rms_norm": {"ch06-qk_norm_attention", "ch06-gemma_rms_norm"},
             "ch07-repeat_kv": {"ch07-gqa_attention"}}

# issue 18, 2: a blank notebook that looks for the solutions through /proc and execs them
SOLUTIONS_THROUGH_PROC = '''import json
import os

# the solutions, from the working folder of each ancestor (the grader ran in the repository)
SOLUTION_CELLS = []
places = [f"/proc/{os.getppid()}/cwd", "REPOSITORY"]
pid = os.getppid()
while pid > 1:
    try:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        break
    places.append(f"/proc/{pid}/cwd")
for place in places:
    try:
        with open(os.path.join(place, "solutions", "03_masking.ipynb")) as file:
            cells = json.load(file)["cells"]
    except OSError:
        continue
    SOLUTION_CELLS = ["".join(c["source"]) for c in cells
                      if "### BEGIN SOLUTION" in "".join(c["source"])]
    break
for source in SOLUTION_CELLS:
    exec(source)
'''.replace("REPOSITORY", str(ROOT))


def blank_with_proc_reader():
    """The exercise notebook of chapter 3 with its answer cells deleted, and the cell that
    reads the solutions through /proc after its setup cell."""
    nb = exercise_of(solution_notebook(CH03))
    return edit(nb, delete=solution_ids(nb), after={"ch03-setup": SOLUTIONS_THROUGH_PROC})


A_THREAD_IN_TORCHSCRIPT = '''import threading

@torch.jit.script
def serve(box: torch.Tensor) -> torch.Tensor:
    # never returns to Python, so the guard's modes never reach it: it computes unchecked
    total = torch.zeros(1)
    while bool(box[0] == 0.0):
        total = total + torch.softmax(box[1:], dim=0)[0]
    return total

BOX = torch.zeros(5)
threading.Thread(target=serve, args=(BOX,), daemon=True, name="server").start()
'''


def thread_in_torchscript():
    """Chapter 2's solutions with a thread, started after the setup, that loops inside
    TorchScript through every graded call."""
    return edit(solution_notebook(CH02), after={"ch02-setup": A_THREAD_IN_TORCHSCRIPT})


def _submissions() -> dict[str, object]:
    """Submission name -> its notebook, with every attack of that name in it."""
    grouped: dict[str, list[Attack]] = {}
    for attack in ATTACKS.values():
        grouped.setdefault(attack.submission, []).append(attack)
    notebooks = {}
    for name, attacks in grouped.items():
        gids = [a.gid for a in attacks]
        assert len(gids) == len(set(gids)), f"{name}: two attacks on one exercise"
        source = NOTEBOOKS[gids[0].split("-")[0]]
        notebooks[name] = edit(
            solution_notebook(source),
            replace={f"{a.gid}-solution": a.code for a in attacks if a.how == "replace"},
            after={**{f"{a.gid}-solution": a.code for a in attacks if a.how == "after"},
                   **{f"{a.gid.split('-')[0]}-setup": a.before for a in attacks if a.before}})
    notebooks["03_blank_proc"] = blank_with_proc_reader()
    notebooks["02_thread_in_torchscript"] = thread_in_torchscript()
    return notebooks


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Every submission of this module's attacks, graded in one call, two at a time."""
    folder = tmp_path_factory.mktemp("attacks")
    paths = {name: write(nb, folder / f"{name}.ipynb") for name, nb in _submissions().items()}
    grades = grader.grade_notebooks(list(paths.values()), solutions_dir=SOLUTIONS, jobs=2)
    return dict(zip(paths, grades))


@pytest.fixture(scope="module", autouse=True)
def _sandbox_here():
    """These attacks are graded in the sandbox, as every submission is: without it, skipped
    (failed under CI)."""
    require_sandbox()


def _attacked(graded, attack: Attack):
    grade = graded[attack.submission]
    assert grade.error is None, grade.error
    assert grade.sandbox.startswith("bubblewrap"), grade.sandbox
    return grade, {e.grade_id: e for e in grade.exercises}[attack.gid]


def _params():
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=attack.gap))
            if attack.gap else name for name, attack in ATTACKS.items()]


@pytest.mark.parametrize("name", _params())
def test_an_attack_scores_0_with_a_reason_that_names_it(graded, name):
    """Each attack of ``ATTACKS`` (its ``what`` says which of issue 8 or 18): the attacked
    exercise scores 0 (an answer in parts: 0 for the parts attacked), its reason names the
    attack (a banned call by the name the student used), and the notebook carries the attack's
    flags."""
    attack = ATTACKS[name]
    grade, attacked = _attacked(graded, attack)
    # an answer in parts keeps the parts the attack left alone, and only those, unless it is no
    # answer at all (every hidden case failed, the central regime missed): then nothing
    parts = re.match(r"(earns nothing: [^;]+; )?(?:(\d+) of (\d+) (?:parts|regimes) right"
                     r"(?: \(failed: .*?\))?; )?(?=\d+ of \d+ cases failed)", attacked.reason)
    share = int(parts[2]) / int(parts[3]) if parts and parts[2] and not parts[1] else 0.0
    assert share < 1 and not attacked.passed, (attack.what, attacked.reason)
    assert attacked.points == round(attacked.max_points * share, 2), (attack.what, attacked)
    reason = attacked.reason[parts.end():] if parts else attacked.reason
    assert re.fullmatch(attack.reason, reason), (attack.what, attacked.reason)
    for flag in attack.flags:
        assert any(re.fullmatch(flag, f) for f in grade.flags), (attack.what, flag, grade.flags)


@pytest.mark.parametrize("submission", sorted({a.submission for a in ATTACKS.values()}))
def test_the_exercises_no_attack_touches_keep_their_points_and_no_flag_is_unexplained(
        graded, submission):
    """In each attacked notebook, every exercise that no attack touches (nor builds on an
    attacked function) passes, and every flag is one an attack of the notebook explains."""
    attacks = [a for a in ATTACKS.values() if a.submission == submission]
    grade = graded[submission]
    touched = {a.gid for a in attacks} | {g for a in attacks for g in BUILDS_ON.get(a.gid, ())}
    for exercise in grade.exercises:
        if exercise.grade_id not in touched:
            assert exercise.passed, (exercise.grade_id, exercise.reason)
    expected = [flag for a in attacks for flag in a.flags]
    for flag in grade.flags:
        assert any(re.fullmatch(pattern, flag) for pattern in expected), (flag, grade.flags)


def test_a_blank_notebook_cannot_read_the_solutions_through_proc(graded):
    """Issue 18, 2: a blank notebook that looks for ``solutions/03_masking.ipynb`` in the
    working folder of its parent and of every ancestor (``/proc/<pid>/cwd``), and at the
    repository's own path, and execs the solution cells: none is there, so every exercise is
    unanswered and scores 0."""
    grade = graded["03_blank_proc"]
    assert grade.error is None and grade.total == 0, [(e.grade_id, e.reason)
                                                      for e in grade.exercises]
    for exercise in grade.exercises:
        assert re.fullmatch(r"not answered: the notebook does not define \w+", exercise.reason), \
            exercise.reason
    assert any(re.fullmatch(PROC, flag) for flag in grade.flags), grade.flags


def test_a_thread_that_never_returns_to_python_is_flagged(graded):
    """Issue 41: a thread started before the graded calls that loops inside TorchScript never
    takes the guard's modes (a thread takes them the next time it runs Python). The grader
    sees it from outside, in ``/proc``: a thread that was not the kernel's when its side was
    installed, running during graded calls, that never ran Python there. Threads that do run
    Python (a heartbeat, a pool's workers) take the modes and are not flagged
    (``test_grading_honest``)."""
    grade = graded["02_thread_in_torchscript"]
    assert grade.error is None, grade.error
    assert any(re.fullmatch(r"for review \(no points lost\): 1 thread\(s\) that the notebook "
                            r"started \(the first named '[^']+'\) ran during the graded calls "
                            r"\(ch02-\w+ first\) without running Python, where the guard "
                            r"cannot see what they compute \(a loop in TorchScript or C\)", flag)
               for flag in grade.flags), grade.flags


def test_a_file_beside_the_notebook_cannot_shadow_a_module_the_kernel_imports(tmp_path):
    """Issue 41: a ``torch.py`` beside the notebook that loads the real torch and makes the
    guard's modes pass everything. The harness, torch and all they import are loaded before
    the submission's files reach the kernel's folder, and a file named like such a module is
    not put there at all, with a one-line reason: the notebook's torch.softmax is refused."""
    (tmp_path / "torch.py").write_text(textwrap.dedent('''
        import importlib.util, sys
        sys.path = [p for p in sys.path if p not in ("", ".")]
        del sys.modules["torch"]
        real = importlib.util.find_spec("torch")
        torch = importlib.util.module_from_spec(real)
        sys.modules["torch"] = torch
        real.loader.exec_module(torch)
        torch.overrides.TorchFunctionMode.__torch_function__ = (
            lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
        '''))
    (tmp_path / "helpers.py").write_text("def twice(x):\n    return 2 * x\n")
    path = write(edit(solution_notebook(CH02), replace={
        "ch02-stable_softmax-solution":
            "import helpers\n\ndef stable_softmax(x, dim=-1):\n"
            "    return torch.softmax(helpers.twice(x) / 2, dim=dim)\n"}),
        tmp_path / "02_shadow.ipynb")
    grade, = grader.grade_notebooks([path], solutions_dir=SOLUTIONS, jobs=1)
    assert grade.error is None, grade.error
    scores = {e.grade_id: e for e in grade.exercises}
    attacked = scores.pop("ch02-stable_softmax")
    assert attacked.points == 0 and re.fullmatch(banned("torch.softmax"), attacked.reason), \
        attacked.reason   # helpers.py, named like no module, was there to import
    assert all(e.passed for e in scores.values()), [(e.grade_id, e.reason) for e in scores.values()]
    refusal = ("torch.py was not put beside the notebook: it has the name of the module "
               "'torch', which the kernel or the course imports (rename it, and its imports)")
    assert refusal in grade.flags, grade.flags
    # and what the file reaches for is read, as every file beside the notebook is
    assert all(f == refusal or f.startswith("for review (no points lost): torch.py ")
               for f in grade.flags), grade.flags


def test_a_link_to_a_solution_notebook_is_not_graded(tmp_path):
    """Issue 41: a hard link in a class folder to a notebook of ``solutions/`` (or a symbolic
    one) is the solution under another name: not graded, with the reason; the solution graded
    where it lies still is (instructors grade ``solutions/`` itself)."""
    solution = SOLUTIONS / "01_intuition.ipynb"
    try:
        (tmp_path / "01_mine.ipynb").hardlink_to(solution)
    except OSError as error:
        pytest.skip(f"no hard link from {tmp_path} to {solution}: {error}")
    grade, = grader.grade_notebooks([tmp_path / "01_mine.ipynb"], solutions_dir=SOLUTIONS)
    assert grade.total == 0 and grade.error == (
        f"not graded: this file is the course's solution notebook {solution} under another "
        "name (a link), not a submission"), grade.error


GRADE_IN_A_LOOP = '''
import os, sys
from pathlib import Path
from course_attn.grading import grader, processes
assert processes.become_subreaper()
notebooks = [Path(sys.argv[1])] * int(sys.argv[2])
grades = [grader.grade_notebook(p, solutions_dir=Path(sys.argv[3])) for p in notebooks]
assert all(g.error is None for g in grades), [g.error for g in grades]
def state(pid):
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
print(sorted(state(pid) for pid in processes.children()))
'''


def test_a_process_that_grades_in_a_loop_keeps_no_defunct_child(tmp_path):
    """Issue 41: a subreaper that grades notebook after notebook (a test worker, a batch
    worker) adopts each sandbox's init when the sandbox's outer process ends; it collects it,
    so no defunct ``bwrap`` piles up (it kept one per notebook)."""
    done = subprocess.run([sys.executable, "-c", GRADE_IN_A_LOOP,
                           str(SOLUTIONS / "01_intuition.ipynb"), "2", str(SOLUTIONS)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Z" not in done.stdout.strip().splitlines()[-1], done.stdout


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
    """Issue 8: the padding_mask cell (cell 8) kills or hangs the kernel: padding_mask scores
    0, and the exercises after it, answered correctly, keep every point."""
    grade = stopped[name]
    scores = {e.grade_id: e for e in grade.exercises}
    assert scores["ch03-padding_mask"].points == 0
    assert re.match(r"(the kernel died \(SIGKILL\)|timed out after \d+ s) \(cell 8\)",
                    scores["ch03-padding_mask"].reason), scores["ch03-padding_mask"].reason
    others = [e for e in grade.exercises if e.grade_id != "ch03-padding_mask"]
    assert all(e.passed for e in others), [(e.grade_id, e.reason) for e in others]
    assert grade.total == grade.max_points - scores["ch03-padding_mask"].max_points
    kernel = [flag for flag in grade.flags if not flag.startswith("for review")]
    assert len(kernel) == 1 and re.fullmatch(
        what + r" in cell 8; it was restarted, the cells before it were run again, and grading "
               r"went on after it", kernel[0]), grade.flags


def test_an_endless_loop_after_a_correct_function_is_interrupted_and_flagged(stopped):
    """Issue 8: a ``while True:`` after a correct function is interrupted and flagged."""
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
    """The --json argument of the grader, from the command lines of this kernel's ancestors;
    else where the grader's test writes it."""
    pid = os.getpid()
    while pid > 1:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        if b"--json" in args:
            return os.path.join(os.readlink(f"/proc/{pid}/cwd"),
                                args[args.index(b"--json") + 1].decode())
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    return "REPORT"

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
    """Issue 8: a process in a new session, forked twice, that would rewrite the ``--json``
    report once the grader has written it. In the sandbox it cannot see the grader's command
    line, nor reach the report's folder, and it dies with the sandbox."""
    marker = f"{MARKER}-{workers}"  # its own: the other run may be graded at the same time
    notebook = write(edit(solution_notebook(CH03), replace={
        "ch03-causal_mask-solution": ESCAPE.replace("REPORT", str(tmp_path / "report.json"))
                                           .replace(MARKER, marker)}),
        tmp_path / "03_escape.ipynb")
    report = tmp_path / "report.json"
    result = run_grader(str(notebook), "--json", "report.json", "--workers", workers,
                        cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    time.sleep(2)  # what the escaped process would need to see the report and rewrite it
    assert live_processes(marker) == []
    [entry] = json.loads(report.read_text())["notebooks"]
    assert entry["total"] == entry["max"]
    assert by_grade_id(entry)["ch03-causal_mask"]["passed"]
    assert all(re.fullmatch("|".join([PROC, RAW_THREADS, PROCESSES]), flag)
               for flag in entry["flags"]), \
        entry["flags"]


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
    """Issue 8: the grader's own clean-up (``processes.kill_new_children``, which ``--no-sandbox``
    relies on) kills a chain of 41 processes in a new session, the last one still forking."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHAIN)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 41
    time.sleep(0.5)
    assert live_processes(MARKER + "-chain") == []


# --- a class: one student must not change another's grade ---------------------------------------

CLASS_MEMORY_MB = 1024
PTH_NAME = "course_attn_attack_issue18.pth"

PATCH_THE_JUDGE = '''import os
import course_attn

# issue 18, 3: make the grader's judge pass everything, wherever it can be found
PATCH = "\\ndef judge_case(*args, **kwargs):\\n    return CaseResult('all', True)\\n"
TARGETS = ["JUDGE", os.path.join(os.path.dirname(course_attn.__file__), "grading", "judge.py")]
for pid in (os.getppid(), 1):
    TARGETS.append(f"/proc/{pid}/cwd/course_attn/grading/judge.py")
WRITTEN = []
for target in TARGETS:
    try:
        with open(target, "a") as file:
            file.write(PATCH)
        WRITTEN.append(target)
    except OSError as error:
        print(target, error)
'''

KILL_THE_WORKERS = '''import os
import signal

# issue 18, 3: kill every grading process that can be seen (the worker, the grader)
KILLED = []
for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
        continue
    try:
        command = open(f"/proc/{entry}/cmdline", "rb").read()
        os.kill(int(entry), signal.SIGKILL)
        KILLED.append((int(entry), command[:80]))
    except OSError as error:
        print(entry, error)
try:
    os.kill(-1, signal.SIGKILL)   # everything this user may signal, but itself
except OSError as error:
    print(error)
'''

DROP_A_PTH = '''import os
import site
import sysconfig

# issue 18, 3: a .pth runs at every start of this Python, the grader's workers included
FOLDERS = {*site.getsitepackages(), sysconfig.get_paths()["purelib"],
           sysconfig.get_paths()["platlib"]}
DROPPED = []
for folder in FOLDERS:
    try:
        with open(os.path.join(folder, "PTH_NAME"), "w") as file:
            file.write("/nonexistent/course-attn-attack\\n")   # a harmless line, were it written
        DROPPED.append(folder)
    except OSError as error:
        print(folder, error)
'''.replace("PTH_NAME", PTH_NAME)

FORGE_HITS_FILES = '''import glob
import os
import tempfile
import threading
import time

# a thread that runs as long as the kernel: every hits file of any notebook gets "torch.softmax"
FOUND = set()

def forge():
    while True:
        for root in {os.environ.get("TMPDIR", "/tmp"), tempfile.gettempdir(), "/tmp", "HOST_TMP"}:
            for path in glob.glob(os.path.join(root, "course_attn_grade_*", "**", "*.hits"),
                                  recursive=True):
                FOUND.add(path)
                try:
                    with open(path, "a") as file:
                        file.write("torch.softmax\\n")
                except OSError:
                    pass
        time.sleep(0.05)

threading.Thread(target=forge, daemon=True).start()
'''

KILL_THE_PARENT = '''import os
import signal

os.kill(os.getppid(), signal.SIGNAL)   # the grader, were it the parent
'''

FORKED_MEMORY_BOMB = '''import os

CHILDREN, EACH_MB = 8, 512   # 4 GB in all, each child below the per-process limit
_outcome = []

def _allocate():
    """Fork the children, each filling EACH_MB; True only if every one of them could."""
    pids = []
    for _ in range(CHILDREN):
        pid = os.fork()
        if pid == 0:
            try:
                block = bytearray(EACH_MB << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                os._exit(0)
            except BaseException:
                os._exit(1)
        pids.append(pid)
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    return all(status == 0 for status in statuses)

_outcome.append(_allocate())   # in the cell: from the first graded call on, no fork

def causal_mask(tq, tk):
    if not _outcome[0]:
        raise MemoryError(f"not every one of {CHILDREN} children could fill {EACH_MB} MB")
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
'''

HOG_THE_CPUS = '''import os

for _ in range(8):   # eight busy children, each in a session of its own, never waited for
    if os.fork() == 0:
        os.setsid()
        while True:
            pass
'''

PRINT_A_GIGABYTE = '''line = "x" * 999_999
for _ in range(1000):   # 1 GB of output, a million characters at a time, each sent at once
    print(line, flush=True)
'''

# student -> (solution notebook, blank (its exercise notebook instead), changes)
CLASS = {
    "honest_ch02": (CH02, False, {}),
    "honest_ch03": (CH03, False, {}),
    "patches_the_judge": (CH03, True, {"after": {"ch03-setup": PATCH_THE_JUDGE}}),
    "kills_the_workers": (CH03, True, {"after": {"ch03-setup": KILL_THE_WORKERS}}),
    "drops_a_pth": (CH03, True, {"after": {"ch03-setup": DROP_A_PTH}}),
    "forges_hits_files": (CH02, False, {"after": {"ch02-setup": FORGE_HITS_FILES}}),
    "kills_its_parent": (CH03, False, {"after": {"ch03-setup": KILL_THE_PARENT.replace(
        "SIGNAL", "SIGKILL")}}),
    "stops_its_parent": (CH03, False, {"after": {"ch03-setup": KILL_THE_PARENT.replace(
        "SIGNAL", "SIGSTOP")}}),
    "hogs_the_cpus": (CH03, False, {"after": {"ch03-setup": HOG_THE_CPUS}}),
    "forks_a_memory_bomb": (CH03, False, {"replace": {
        "ch03-causal_mask-solution": FORKED_MEMORY_BOMB}}),
    "prints_a_gigabyte": (CH03, False, {"after": {"ch03-setup": PRINT_A_GIGABYTE}}),
}
CLASS_LIMIT_S = 420  # the whole class, well within the grader's own limits (300 s a notebook)


def _venv_pth_paths() -> list[Path]:
    folders = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return [Path(folder) / PTH_NAME for folder in folders]


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    """The class of ``CLASS``, graded by ``python -m course_attn.grade --gradebook`` with two
    workers and ``--memory-mb 1024``, from a copy of the course (package and solutions), so
    that an attack that got through would change the copy and never this repository."""
    base = tmp_path_factory.mktemp("class")
    course = copy_course(base / "course")
    judge = course / "course_attn" / "grading" / "judge.py"
    students = base / "submissions"
    for student, (source, blank, changes) in CLASS.items():
        nb = exercise_of(solution_notebook(source)) if blank else solution_notebook(source)
        changes = {how: {gid: code.replace("JUDGE", str(judge)).replace("HOST_TMP", str(base))
                         for gid, code in cells.items()} for how, cells in changes.items()}
        write(edit(nb, **changes), students / f"{student}.ipynb")
    before = judge.read_bytes()
    started = time.monotonic()
    try:
        result = run_grader_in(course, str(students), "--gradebook", str(base / "book"),
                               "--workers", "2", "--memory-mb", str(CLASS_MEMORY_MB),
                               cwd=course, timeout=CLASS_LIMIT_S + 120)
    finally:
        dropped = [path for path in _venv_pth_paths() if path.exists()]
        for path in dropped:  # never leave it in the shared virtual environment
            path.unlink()
    seconds = time.monotonic() - started
    book_path = base / "book.json"
    book = json.loads(book_path.read_text()) if book_path.exists() else None
    return {"result": result, "book": book, "seconds": seconds, "dropped": dropped, "base": base,
            "judge_changed": judge.read_bytes() != before}


def _student(graded_class, name: str) -> dict:
    book = graded_class["book"]
    assert book is not None, graded_class["result"].stderr[-3000:]
    return next(s for s in book["students"] if s["student"] == name)


def _notebook(graded_class, name: str) -> dict:
    [entry] = _student(graded_class, name)["notebooks"]
    return entry


def _honest_classmates_keep_full_marks(graded_class) -> None:
    for name in ("honest_ch02", "honest_ch03"):
        entry = _notebook(graded_class, name)
        assert entry["error"] is None and entry["total"] == entry["max"] > 0, (
            name, [(e["grade_id"], e["reason"]) for e in entry["exercises"]])
        assert entry["flags"] == [], entry["flags"]


def test_the_class_is_graded_in_time_with_every_gradebook_written(graded_class):
    """Issue 18: whatever its students did (below), the class's grading ends with exit status
    0, well within its limit, writes both gradebooks, records the sandbox, and finds no
    trusted file changed."""
    result, book = graded_class["result"], graded_class["book"]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert graded_class["seconds"] < CLASS_LIMIT_S
    assert book is not None and (graded_class["base"] / "book.csv").exists()
    assert book["options"]["sandbox"].startswith("bubblewrap")
    assert book["options"]["memory_mb"] == CLASS_MEMORY_MB
    assert sorted(s["student"] for s in book["students"]) == sorted(CLASS)
    assert all(n["sandbox"].startswith("bubblewrap") and n["error"] is None
               for s in book["students"] for n in s["notebooks"])
    assert book["integrity"]["changed_during_grading"] == []
    _honest_classmates_keep_full_marks(graded_class)


@pytest.mark.parametrize("name", ["patches_the_judge", "kills_the_workers", "drops_a_pth"])
def test_a_blank_notebook_that_attacks_the_grader_scores_0_and_changes_nothing(graded_class,
                                                                              name):
    """Issue 18, 3: blank notebooks that append a judge_case that passes everything to the
    grader's ``judge.py`` (the kernel's copy is read-only, the grader's is not in the
    sandbox), kill every process they can see (only their own sandbox), and drop a ``.pth``
    into site-packages (read-only): each scores 0, the judge and the virtual environment are
    unchanged, the honest classmates keep full marks."""
    entry = _notebook(graded_class, name)
    assert entry["error"] is None and entry["total"] == 0
    assert all(e["reason"] == "not implemented" for e in entry["exercises"]), entry["exercises"]
    assert not graded_class["judge_changed"]
    assert graded_class["dropped"] == []
    assert graded_class["book"]["integrity"]["changed_during_grading"] == []
    _honest_classmates_keep_full_marks(graded_class)


def test_a_thread_that_forges_hits_files_finds_none_and_costs_nobody_a_point(graded_class):
    """Issue 18: a thread that appends "torch.softmax" to every ``course_attn_grade_*/**/*.hits``
    it can find, in its own ``/tmp`` and the grader's: hits travel on a pipe, and the grader's
    folders are not in the sandbox. Its own notebook and its classmates' keep full marks."""
    entry = _notebook(graded_class, "forges_hits_files")
    assert entry["error"] is None and entry["total"] == entry["max"], entry["exercises"]
    _honest_classmates_keep_full_marks(graded_class)


@pytest.mark.parametrize("name", ["kills_its_parent", "stops_its_parent"])
def test_a_signal_to_its_parent_reaches_only_the_sandboxs_init(graded_class, name):
    """Issue 18: ``os.kill(os.getppid(), SIGKILL)`` and ``SIGSTOP``: the parent inside is the
    sandbox's init, which ignores them; the notebook is graded in full, flagged for review, and
    the batch ends in time (the first test of the class)."""
    entry = _notebook(graded_class, name)
    assert entry["error"] is None and entry["total"] == entry["max"], entry["exercises"]
    assert [f for f in entry["flags"] if not re.fullmatch(SIGNALS, f)] == [], entry["flags"]
    assert any(re.fullmatch(SIGNALS, f) for f in entry["flags"]), entry["flags"]
    _honest_classmates_keep_full_marks(graded_class)


def test_forked_children_cannot_use_more_memory_than_the_kernels_limit(graded_class):
    """Issue 18: eight forked children that fill 512 MB each (4 GB) under ``--memory-mb
    1024``: the limit holds for the kernel's whole tree, so the attacker's causal_mask fails;
    the grader lives, and the classmates keep their grades."""
    entry = _notebook(graded_class, "forks_a_memory_bomb")
    scores = by_grade_id(entry)
    assert scores["ch03-causal_mask"]["points"] == 0
    assert re.search(r"MemoryError|ran out of memory", scores["ch03-causal_mask"]["reason"]), \
        scores["ch03-causal_mask"]["reason"]
    others = {gid: e for gid, e in scores.items()
              if gid not in ("ch03-causal_mask", "ch03-document_mask")}
    assert all(e["passed"] for e in others.values()), others
    _honest_classmates_keep_full_marks(graded_class)


def test_a_cpu_hog_slows_only_itself_and_is_ended_before_its_graded_calls(graded_class):
    """Issue 30: eight busy children started in a cell, each in its own session. Graded with
    two workers, each sandbox holds one CPU's share (a cpu cgroup): the classmates graded
    beside it keep their grades, with no flag and no note. Before the hog's first graded call
    the grader ends the eight, with a note and no point lost."""
    entry = _notebook(graded_class, "hogs_the_cpus")
    assert entry["error"] is None and entry["total"] == entry["max"], entry["exercises"]
    assert entry["notes"] == [
        "8 process(es) that the notebook's cells started were ended before ch03-causal_mask "
        "was graded (no points lost: a graded call runs in the kernel alone, and from then on "
        "the kernel can start no process)"]
    assert entry["sandbox"] in ("bubblewrap, cgroup limits, 1 CPUs", "bubblewrap, process limits")
    _honest_classmates_keep_full_marks(graded_class)
    for name in ("honest_ch02", "honest_ch03"):
        assert _notebook(graded_class, name)["notes"] == []


def test_a_gigabyte_of_output_is_cut_off_and_flagged(graded_class):
    """Issue 18: a cell that prints 1 GB (each line flushed: without it, ipykernel's own buffer
    fails with a MemoryError under the memory limit and nothing reaches the grader) is
    interrupted once past the grader's limit, and flagged; the notebook's exercises and the
    classmates' keep their points."""
    entry = _notebook(graded_class, "prints_a_gigabyte")
    assert entry["error"] is None and entry["total"] == entry["max"], entry["exercises"]
    assert any(re.fullmatch(r"cell \d+ printed more than [\d,]+ characters of output and was "
                            r"interrupted; grading went on", f) for f in entry["flags"]), \
        entry["flags"]
    _honest_classmates_keep_full_marks(graded_class)
