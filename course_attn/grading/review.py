"""Flags for a human reviewer: code in a submission that reaches for the machinery around it.

The sandbox keeps a submission from the grader, the other kernels and the solutions; the guard
checks every operation the graded functions run. What a submission can still do is undo the
guard inside its own process (pop torch's modes, walk the stack to the grader's frames, patch
the interpreter). That is deliberate, and visible in the code: these flags point a reviewer at
it. They cost no points; honest code rarely needs any of these names.

The scan reads the submission's code as Python resolves its names (it never runs it): every
name and attribute chain is read through the imports and the plain assignments that bind it
(``from gc import get_objects as g`` makes ``g()`` read ``gc.get_objects``; ``f = sys`` makes
``f._getframe`` read ``sys._getframe``), and a string that is used as a name is read as that
name: ``getattr(sys, "_get" + "frame")``, ``vars(module)["__globals__"]``,
``importlib.import_module("gc")``, ``sys.modules.get("ctypes")``, with the string folded where
it is made of literals (``+``, f-strings, ``"".join``, a variable that only ever holds one). A
name computed at run time on a module that leads to the interpreter (``getattr(sys, name)``) is
a sign of its own; on anything else (``getattr(torch, cfg.dtype_name)``) it is everyday code.
A comment, a docstring or a string used as data is not read (but a path into ``/proc`` is).
What reads a name without reaching the grader or the guard is not flagged:
``multiprocessing.cpu_count()``, ``"google.colab" in sys.modules``, ``print(cfg.__dict__)``.
"""

import ast
import io
import re
import tokenize

# Dunder attributes that honest code reads (``type(x).__name__``, ``super().__init__()``,
# ``print(cfg.__dict__)``); any other (``f.__globals__``, ``f.__closure__``) is a sign.
_PLAIN_DUNDERS = ("name", "qualname", "doc", "module", "version", "file", "class", "init",
                  "call", "repr", "str", "len", "iter", "next", "enter", "exit", "getitem",
                  "setitem", "contains", "eq", "hash", "post_init", "annotations", "dict",
                  "main", "slots", "all")

STACK = "walks the call stack (sys._getframe, inspect.stack, f_back)"
GC = "searches the interpreter's objects (gc)"
CTYPES = "calls C directly (ctypes)"
PROC = "reads /proc"
SIGNALS = "sends signals (os.kill)"
DISPATCH = "hooks into torch's dispatch (__torch_function__, torch modes)"
MACHINERY = "replaces the kernel's own machinery (IPython's user_expressions, execution, replies)"
GRADER = "imports or reaches the grader's package (course_attn.grading)"
HOOKS = "changes the interpreter's hooks or module table (sys.setprofile, sys.modules)"
OBJECTS = "rewrites or searches Python's own objects (builtins, code objects, __subclasses__)"
RAW_THREADS = "starts a thread that no check follows (_thread)"
RUN_TIME_CODE = "runs code built at run time (exec, eval, compile, __import__, importlib)"
COMPUTED = "reaches an attribute by a name computed at run time (getattr, setattr, delattr)"
DUNDERS = "reads Python's internals through a dunder attribute (__globals__, __closure__, __dict__)"
C_CORE = "reaches the module table or torch's C core (sys.modules, torch._C, dispatch keys)"
PROCESSES = "starts another process (multiprocessing, subprocess, os.fork, os.system)"

# (pattern searched in each resolved name: a dotted path such as ``gc.get_objects``,
# ``torch._C._DisableTorchDispatch``, ``frame.f_back``, ``get_ipython().kernel``; why)
_SIGNS = (
    (r"^sys\.(_getframe|_current_frames|_current_exceptions)\b|"
     r"^inspect\.(currentframe|stack|trace|getouterframes|getinnerframes|getframeinfo|"
     r"getargvalues|getclosurevars)\b|^traceback\.(walk_stack|walk_tb)\b|"
     r"\.(f_back|f_globals|f_locals|f_builtins|tb_frame|gi_frame|cr_frame|ag_frame)\b|"
     r"^\?\.(_getframe|_current_frames|currentframe|walk_stack)$",
     STACK),
    (r"^gc\.(get_objects|get_referrers|get_referents|freeze|unfreeze|get_freeze_count)\b|"
     r"^\?\.(get_objects|get_referrers|get_referents)$",
     GC),
    (r"^_?(ctypes|cffi)\b", CTYPES),
    (r"^(os|posix)\.(kill|killpg|pidfd_send_signal)\b|^signal\.(pthread_kill|raise_signal)\b",
     SIGNALS),
    (r"__torch_function__|__torch_dispatch__|TorchFunctionMode|TorchDispatchMode|"
     r"_python_dispatch|_pop_mode|_push_mode|_pop_torch|_push_on_torch|DisableTorchFunction|"
     r"_DisableTorchDispatch|_disable_current_modes|_get_current_function_mode|"
     r"_get_current_dispatch_mode|_get_function_stack_at|_len_torch_function_stack|"
     r"^torch\.overrides\.(_get|_pop|_push|_len|_is_torch_function_mode)",
     DISPATCH),
    (r"\b(user_expressions|do_execute|shell_handlers|control_handlers|display_formatter|"
     r"displaypub|input_transformers_post|input_transformers_cleanup|ast_transformers)\b|"
     r"\bsession\.send\b|get_ipython\(\)\.(kernel|events|run_cell|ev|ex)\b|"
     r"\b(InteractiveShell|IPythonKernel|ZMQInteractiveShell)\b|^(ipykernel|zmq)\b",
     MACHINERY),
    (r"^course_attn\.grading\b|CourseAttnHarness|^course_attn_(harness|confine)\b", GRADER),
    (r"^sys\.(setprofile|settrace|monitoring|addaudithook)\b|"
     r"^threading\.(setprofile|settrace)|^\?\.(setprofile|settrace)$|"
     r"^sys\.modules\.(pop|update|clear|setdefault|"
     r"__setitem__|__delitem__|popitem)\b|^sys\.modules=$|^sys\.modules\[\]=$",
     HOOKS),
    (r"__subclasses__|__builtins__|^builtins\b|co_filename|\bCodeType\b|\.__code__=$|"
     r"^types\.(CodeType|FunctionType)\b",
     OBJECTS),
    (r"^_thread\.start_new|^torch\.jit\._?fork\b", RAW_THREADS),
    (r"^(builtin:|builtins\.)(exec|eval|compile|__import__)$|^importlib\b|^runpy\b|"
     r"^code\.(interact|"
     r"InteractiveConsole|InteractiveInterpreter)\b",
     RUN_TIME_CODE),
    # (a string that is a dunder's name is read as one only for the dunders that lead to code
    # and frames: {"__tensor__": ...} is data)
    (r"^(?!\?\.)[^=]*\.__(?!(?:" + "|".join(_PLAIN_DUNDERS) + r")__)\w+__(\b|=$)|"
     r"^\?\.__(globals|closure|code|builtins|subclasses|self|func|defaults|kwdefaults|"
     r"traceback|base|bases|mro|getattribute|reduce_ex|reduce)__$", DUNDERS),
    (r"^sys\.modules(\.(values|items|keys|copy|__iter__))?$|^torch\._C\b|^\?\._C$|"
     r"\bDispatchKey(Set)?\b|"
     r"_(Exclude|Include)DispatchKeyGuard|\b_dispatch_tls",
     C_CORE),
    (r"^multiprocessing\.(?!cpu_count$)|^subprocess\b|^concurrent\.futures\."
     r"ProcessPoolExecutor\b|^pty\b|^os\.(fork\w*|system|popen|exec\w*|spawn\w*|"
     r"posix_spawn\w*)\b|^posix\.",
     PROCESSES),
)
_COMPILED = tuple((re.compile(pattern), why) for pattern, why in _SIGNS)

# Modules whose attributes lead to the interpreter, the grader or another process: an attribute
# of one named at run time is a sign (of any other module, it is everyday code).
_SENSITIVE = re.compile(r"^(sys|gc|inspect|builtins|os|posix|ctypes|_ctypes|importlib|"
                        r"threading|_thread|traceback|types|signal|subprocess|multiprocessing|"
                        r"torch\._C|torch\.overrides|torch\.utils\._python_dispatch|"
                        r"course_attn\.grading|IPython|ipykernel|get_ipython\(\)|builtin:\w+)"
                        r"(\.|$)")
# Imports that only reach a process through what the code then calls on them (a bare
# ``import multiprocessing`` for ``cpu_count()`` is everyday code).
_USED_NOT_IMPORTED = ("multiprocessing",)
_BUILTINS = {"exec", "eval", "compile", "__import__", "getattr", "setattr", "delattr",
             "hasattr", "vars", "globals", "locals", "open", "print"}
_MAGIC = re.compile(r"^(\s*)([%!].*|[\w.]+\?\??)\s*$")  # magics, shell lines, obj? help


def _parse(source: str) -> ast.Module | None:
    """The cell as Python, IPython's magics and shell lines read as ``pass``; None if it is not
    Python even then."""
    lines = [(_MAGIC.sub(r"\1pass", line) if _MAGIC.match(line) else line)
             for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class _Names:
    """The names a submission binds by import or plain assignment (over all its cells and
    files: a name bound in one cell is used in another), and the strings its variables hold."""

    def __init__(self, trees):
        self.aliases: dict[str, set[str]] = {}
        self.strings: dict[str, set[str | None]] = {}
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        local = alias.asname or alias.name.split(".")[0]
                        full = alias.name if alias.asname else alias.name.split(".")[0]
                        self.aliases.setdefault(local, set()).add(full)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    for alias in node.names:
                        if alias.name != "*":
                            self.aliases.setdefault(alias.asname or alias.name, set()).add(
                                f"{node.module}.{alias.name}")
        for tree in trees:  # assignments read the imports above; two rounds reach a chain of two
            for _ in range(2):
                for node in ast.walk(tree):
                    targets = node.targets if isinstance(node, ast.Assign) else \
                        [node.target] if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and \
                        node.value is not None else []
                    for target in targets:
                        if isinstance(target, ast.Name):
                            self._bind(target.id, node.value)

    def _bind(self, name: str, value) -> None:
        text = self.fold(value)
        if text is not None or isinstance(value, (ast.Constant, ast.JoinedStr, ast.BinOp)):
            self.strings.setdefault(name, set()).add(text)
            return
        for resolved in self.resolve(value):
            if resolved != name:
                self.aliases.setdefault(name, set()).add(resolved)

    def resolve(self, node) -> set[str]:
        """The dotted names an expression may stand for (``sys._getframe``, ``torch._C``,
        ``get_ipython().kernel``); empty when it is not a name."""
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return self.aliases[node.id] | {node.id}
            return {f"builtin:{node.id}" if node.id in _BUILTINS else node.id}
        if isinstance(node, ast.Attribute):
            return {f"{base}.{node.attr}" for base in self.resolve(node.value) or {"?"}}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "get_ipython":
            return {"get_ipython()"}
        if isinstance(node, ast.Subscript):  # sys.modules["gc"], vars(m)["f"]
            return self._entry(node.value, node.slice)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "pop") and node.args:  # sys.modules.get("gc")
            found = self._entry(node.func.value, node.args[0])
            if found:
                return found
        if isinstance(node, ast.Call):  # vars(x), x.__dict__: the object itself
            named = self.resolve(node.func)
            if named & {"builtin:vars"} and node.args:
                return self.resolve(node.args[0])
            if any(n.startswith("importlib.import_module") or n == "builtin:__import__"
                   for n in named) and node.args:
                text = self.fold(node.args[0])
                return {text} if text else set()
        return set()

    def _entry(self, namespace, key) -> set[str]:
        """What ``namespace[key]`` stands for, where the namespace is a module table or an
        object's attributes and the key folds to a string."""
        owners, text = _namespace_of(namespace, self), self.fold(key)
        if owners is None or text is None:
            return set()
        return {text if owner == "sys.modules" else f"{owner}.{text}" for owner in owners}

    def fold(self, node) -> str | None:
        """The string an expression always is, where it is made of literals; else None."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.fold(node.left), self.fold(node.right)
            return left + right if left is not None and right is not None else None
        if isinstance(node, ast.JoinedStr):
            parts = [self.fold(v.value) if isinstance(v, ast.FormattedValue) else self.fold(v)
                     for v in node.values]
            return "".join(parts) if all(p is not None for p in parts) else None
        if isinstance(node, ast.Name) and len(self.strings.get(node.id, ())) == 1:
            return next(iter(self.strings[node.id]))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "join" and len(node.args) == 1 and \
                isinstance(node.args[0], (ast.List, ast.Tuple)):
            glue = self.fold(node.func.value)
            parts = [self.fold(e) for e in node.args[0].elts]
            if glue is not None and all(p is not None for p in parts):
                return glue.join(parts)
        return None


def _uses(tree, names: _Names) -> tuple[set[str], set[str]]:
    """The resolved names a tree uses, and the signs found by the shape of the code (not by a
    name)."""
    found: set[str] = set()
    signs: set[str] = set()
    inner = set()  # nodes read as part of something larger: a longer chain, a lookup by key
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Attribute, ast.Name)):
            inner.add(id(node.value))
        elif isinstance(node, ast.Subscript) and _namespace_of(node.value, names) is not None:
            inner.add(id(node.value))  # read by _subscripted, with its key
        elif isinstance(node, ast.Compare) and all(isinstance(op, (ast.In, ast.NotIn))
                                                   for op in node.ops):
            inner.update(id(c) for c in node.comparators)  # "google.colab" in sys.modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in _USED_NOT_IMPORTED:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            resolved = names.resolve(node)
            found.update(resolved)
            if isinstance(node.ctx, (ast.Store, ast.Del)):  # written: "sys.modules=" too
                found.update(n + "=" for n in resolved)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and \
                id(node) not in inner:
            found.update(names.resolve(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(f"def:{node.name}")
        elif isinstance(node, ast.Call):
            found.update(_named_by_string(node, names, signs))
        elif isinstance(node, ast.Subscript):
            found.update(_subscripted(node, names, signs))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.isidentifier() and node.value != "__main__":
            found.add(f"?.{node.value}")  # a name written as a string, wherever it is used
    return found, signs


def _named_by_string(call: ast.Call, names: _Names, signs: set[str]) -> set[str]:
    """What ``getattr(obj, "name")``, ``setattr``, ``delattr``, ``hasattr``, ``x.get("name")``
    on a module table or namespace, ``importlib.import_module("m")`` and ``__import__("m")``
    name; a name computed at run time on a sensitive module adds COMPUTED to ``signs``."""
    function = names.resolve(call.func)
    if function & {"builtin:getattr", "builtin:setattr", "builtin:delattr",
                   "builtin:hasattr"} and len(call.args) >= 2:
        owners, text = names.resolve(call.args[0]), names.fold(call.args[1])
        if text is None:
            if any(_SENSITIVE.match(o) for o in owners):
                signs.add(COMPUTED)
            return set()
        suffix = "=" if function & {"builtin:setattr", "builtin:delattr"} else ""
        return {f"{o}.{text}{suffix}" for o in owners or {"?"}} | {f"?.{text}"}
    if any(n.startswith(("importlib.import_module", "builtin:__import__")) for n in function):
        text = names.fold(call.args[0]) if call.args else None
        return {text} if text else set()
    if isinstance(call.func, ast.Attribute) and call.func.attr in ("get", "pop", "setdefault") \
            and call.args:
        owners = _namespace_of(call.func.value, names)
        text = names.fold(call.args[0])
        if owners is not None:
            if text is None:
                if any(_SENSITIVE.match(o) or o == "sys.modules" for o in owners):
                    signs.add(COMPUTED)
                return set()
            return _namespace_entry(owners, text, call.func.attr != "get")
    return set()


def _namespace_of(node, names: _Names) -> set[str] | None:
    """The owners whose names ``node`` maps to their values: ``sys.modules`` (module names),
    ``vars(x)`` and ``x.__dict__`` (x's attributes); None for anything else."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return names.resolve(node.value) or {"?"}
    if isinstance(node, ast.Call) and names.resolve(node.func) & {"builtin:vars"} and node.args:
        return names.resolve(node.args[0]) or {"?"}
    if "sys.modules" in names.resolve(node):
        return {"sys.modules"}
    return None


def _namespace_entry(owners: set[str], key: str, written: bool) -> set[str]:
    suffix = "=" if written else ""
    return {(key if owner == "sys.modules" else f"{owner}.{key}") + suffix
            for owner in owners} | ({"sys.modules[]="} if written and "sys.modules" in owners
                                    else set()) | {f"?.{key}"}


def _subscripted(node: ast.Subscript, names: _Names, signs: set[str]) -> set[str]:
    owners = _namespace_of(node.value, names)
    if owners is None:
        return set()
    text = names.fold(node.slice)
    written = isinstance(node.ctx, (ast.Store, ast.Del))
    if text is None:
        if written or any(_SENSITIVE.match(o) or o == "sys.modules" for o in owners):
            signs.add(COMPUTED)
        return set()
    return _namespace_entry(owners, text, written)


def _code_only(source: str) -> str:
    """``source`` without its comments and string literals, for a cell that is not Python."""
    kept = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type not in (tokenize.COMMENT, tokenize.STRING):
                kept.append(token.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    return " ".join(kept)


def _proc_paths(source: str) -> bool:
    """Whether a string literal of ``source`` is a path into /proc (data, but this one a sign)."""
    try:
        return any(token.type == tokenize.STRING and "/proc" in token.string
                   for token in tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return "/proc" in source


def _signs(source: str, tree, names: _Names) -> set[str]:
    if tree is None:  # not Python: its dotted names, read as written
        code = re.sub(r"\s*\.\s*", ".", _code_only(source))
        used = set(re.findall(r"[A-Za-z_][\w.]*(?:\(\))?[\w.]*", code))
        signs = set()
    else:
        used, signs = _uses(tree, names)
    for name in used:
        for pattern, why in _COMPILED:
            if pattern.search(name):
                signs.add(why)
    if _proc_paths(source):
        signs.add(PROC)
    return signs


def review_flags(sources, label=None, helpers=None) -> list[str]:
    """One flag per kind of sign, naming the cells and files it is in. ``sources``: (cell
    index, code) of every code cell the student wrote or changed, whether the grader runs it
    or not (``label(index)`` names a cell; by default "cell N", from 1); ``helpers`` (file
    name -> bytes: the Python files beside the notebook, which its code can import) are read
    as its cells are. Names are resolved across all of them."""
    label = label or (lambda index: f"cell {index + 1}")
    items = [(label(index), source) for index, source in sources if source.strip()]
    items += [(name, data.decode("utf-8", errors="replace"))
              for name, data in sorted((helpers or {}).items())]
    trees = [_parse(source) for _, source in items]
    names = _Names([t for t in trees if t is not None])
    found: dict[str, list[str]] = {}
    for (where, source), tree in zip(items, trees):
        for why in _signs(source, tree, names):
            found.setdefault(why, []).append(where)
    order = [why for _, why in _SIGNS] + [PROC, COMPUTED]
    return [f"for review (no points lost): {', '.join(found[why])} {why}"
            for why in sorted(found, key=order.index)]
