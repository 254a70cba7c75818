"""Flags for a human reviewer: code in a submission that reaches for the machinery around it.

The sandbox keeps a submission from the grader, the other kernels and the solutions; the guard
checks every operation the graded functions run. What a submission can still do is undo the
guard inside its own process (pop torch's modes, walk the stack to the grader's frames, patch
the interpreter). That is deliberate, and visible in the code: these flags point a reviewer at
it. They cost no points; honest code rarely needs any of these names.

The scan reads the submission's code cells as text (it never runs them), tokenised, so a name in
a comment or a string is not flagged, and a name built at run time is: ``"sys._getframe"`` in a
string is not, ``getattr(sys, "_get" + "frame")`` is, through its ``getattr`` of ``sys``.
"""

import io
import re
import tokenize

# Dunder attributes that honest code reads (``type(x).__name__``, ``super().__init__()``);
# any other (``f.__globals__``, ``f.__closure__``, ``obj.__dict__``) is a sign.
_PLAIN_DUNDERS = ("name", "qualname", "doc", "module", "version", "file", "class", "init",
                  "call", "repr", "str", "len", "iter", "next", "enter", "exit", "getitem",
                  "setitem", "contains", "eq", "hash", "post_init", "annotations")

# (pattern over the code's names and attributes, what to tell the reviewer)
_SIGNS = (
    (r"\bsys\s*\.\s*_getframe\b|\bsys\s*\.\s*_current_frames\b|"
     r"\binspect\s*\.\s*(currentframe|stack|getouterframes)\b|\.f_back\b|\.f_globals\b|"
     r"\.f_locals\b",
     "walks the call stack (sys._getframe, inspect.stack, f_back)"),
    (r"\bgc\s*\.\s*(get_objects|get_referrers|get_referents)\b|\bimport\s+gc\b",
     "searches the interpreter's objects (gc)"),
    (r"\bctypes\b|\bcffi\b", "calls C directly (ctypes)"),
    (r"/proc\b", "reads /proc"),
    (r"\bos\s*\.\s*(kill|killpg)\b|\bsignal\s*\.\s*(pthread_kill|raise_signal)\b",
     "sends signals (os.kill)"),
    (r"__torch_function__|__torch_dispatch__|TorchFunctionMode|TorchDispatchMode|"
     r"_python_dispatch|_pop_mode|_push_mode|_pop_torch|_push_on_torch|DisableTorchFunction|"
     r"_DisableTorchDispatch|_disable_current_modes|_get_current_function_mode|"
     r"_get_current_dispatch_mode|_get_function_stack_at|_len_torch_function_stack",
     "hooks into torch's dispatch (__torch_function__, torch modes)"),
    (r"\buser_expressions\b|\bdo_execute\b|\bshell_handlers\b|\bcontrol_handlers\b|"
     r"\bdisplay_formatter\b|\bdisplaypub\b|\bsession\s*\.\s*send\b|"
     r"get_ipython\s*\(\s*\)\s*\.\s*(kernel|events|run_cell|ev|ex)\b|"
     r"\b(InteractiveShell|IPythonKernel|ZMQInteractiveShell)\b",
     "replaces the kernel's own machinery (IPython's user_expressions, execution, replies)"),
    (r"course_attn\s*\.\s*grading|from\s+course_attn\s+import\s+grading|CourseAttnHarness",
     "imports or reaches the grader's package (course_attn.grading)"),
    (r"\bsys\s*\.\s*(setprofile|settrace)\b|\bthreading\s*\.\s*(setprofile|settrace)|"
     r"\bsys\s*\.\s*modules\s*(\[[^\]]*\]\s*=[^=]|\.\s*(pop|update|clear|setdefault|__setitem__))|"
     r"\bdel\s+sys\s*\.\s*modules",
     "changes the interpreter's hooks or module table (sys.setprofile, sys.modules)"),
    (r"__subclasses__|__builtins__|\bbuiltins\b|co_filename|CodeType|\.__code__\s*=",
     "rewrites or searches Python's own objects (builtins, code objects, __subclasses__)"),
    (r"\b_thread\s*\.\s*start_new", "starts a thread that no check follows (_thread)"),
    # code that no scan can read: a string run as code, a module or attribute named at run time
    (r"(?<!\.)(?<!\.\s)\b(exec|eval|compile)\s*\(|\b__import__\b|\bimportlib\b",
     "runs code built at run time (exec, eval, compile, __import__, importlib)"),
    (r"\b(getattr|setattr|delattr)\s*\([^,]*,\s*[^\s,)]",
     "reaches an attribute by a name computed at run time (getattr, setattr, delattr)"),
    (r"\.\s*__(?!(?:" + "|".join(_PLAIN_DUNDERS) + r")__)\w+__",
     "reads Python's internals through a dunder attribute (__globals__, __closure__, __dict__)"),
    (r"(?<!\bin )\bsys\s*\.\s*modules\b|\btorch\s*\.\s*_C\b|\bDispatchKey(Set)?\b|"
     r"_(Exclude|Include)DispatchKeyGuard|\b_dispatch_tls",
     "reaches the module table or torch's C core (sys.modules, torch._C, dispatch keys)"),
    # ("google.colab" in sys.modules, the Colab cell's test, only asks)
    (r"\bmultiprocessing\b|\bsubprocess\b|\bProcessPoolExecutor\b|\bpty\b|"
     r"\bos\s*\.\s*(fork\w*|system|popen|exec\w*|spawn\w*|posix_spawn\w*)\b",
     "starts another process (multiprocessing, subprocess, os.fork, os.system)"),
)
_COMPILED = tuple((re.compile(pattern), why) for pattern, why in _SIGNS)


def _code_only(source: str) -> str:
    """``source`` without its comments and string literals (IPython magics and shell lines,
    which are not Python, are kept as they are)."""
    kept = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type not in (tokenize.COMMENT, tokenize.STRING):
                kept.append(token.string)
            elif token.type == tokenize.STRING and "/proc" in token.string:
                kept.append("/proc")  # a path is data, but this one is a sign
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    return " ".join(kept)


def review_flags(nb, label, protected=frozenset(), helpers=None) -> list[str]:
    """One flag per kind of sign, naming the cells and files it is in (``label(index)`` names
    a cell); the cells at ``protected`` indices (the course's own, put back) are not read;
    ``helpers`` (file name -> bytes: the Python files beside the notebook, which its code can
    import) are read as its cells are."""
    found: dict[str, list[str]] = {}
    sources = [(label(index), cell.source) for index, cell in enumerate(nb.cells)
               if index not in protected and cell.cell_type == "code"]
    sources += [(name, data.decode("utf-8", errors="replace"))
                for name, data in sorted((helpers or {}).items())]
    for where, source in sources:
        if not source.strip():
            continue
        code = _code_only(source)
        for pattern, why in _COMPILED:
            if pattern.search(code):
                found.setdefault(why, []).append(where)
    return [f"for review (no points lost): {', '.join(cells)} {why}"
            for why, cells in found.items()]
