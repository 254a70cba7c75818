"""What runs inside the student's kernel: values as plain data, a watch for banned calls, and
the evaluation of one exercise on inputs that the grader sends.

The grader never trusts this code's verdict, because there is none here: the kernel computes the
student's outputs for the grader's inputs and sends them back as data; the grader compares them
with references it computes itself (``judge.py``). What this module adds is the watch for banned
calls, which must run where the student's function runs.

The module is self-contained (standard library and torch only): the grader sends its source to
each kernel and runs it there in a fresh namespace, rather than importing the kernel's copy of
the package, which the submission could have changed. ``check()`` imports it in-process.

Plain data (``encode`` / ``decode``): None, bool, int, float, str, lists, tuples, dicts with
string keys, and tensors as ``{"__tensor__": {dtype, shape, device, data (base64 of the raw
bytes)}}``. Nothing is ever unpickled or executed on decoding.
"""

import base64
import ctypes
import json
import math
import os
import sys
import threading
import traceback

import torch

MAX_DEPTH = 32
MAX_BYTES = 64 * 1024 * 1024
MAX_DIMS = 64
SWITCHES_OFF = "(it switches off the watch for banned calls)"  # ends the name of such a hit
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)}


class WireError(ValueError):
    """A value that is not plain data, or data that does not decode."""


def encode(value, depth: int = 0):
    """``value`` as JSON-compatible plain data; raises WireError for anything else."""
    if depth > MAX_DEPTH:
        raise WireError("nested too deeply")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if type(tensor) is not torch.Tensor:
            tensor = tensor.as_subclass(torch.Tensor)
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise WireError(f"a tensor of dtype {tensor.dtype}")
        device = str(tensor.device)
        raw = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() \
            if tensor.numel() else b""
        return {"__tensor__": {"dtype": name, "shape": list(tensor.shape), "device": device,
                               "data": base64.b64encode(raw).decode("ascii")}}
    if isinstance(value, (list, tuple)):
        items = [encode(item, depth + 1) for item in value]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise WireError("a dict whose keys are not all strings")
        return {"__dict__": {key: encode(item, depth + 1) for key, item in value.items()}}
    raise WireError(f"a value of type {type(value).__name__}")


def decode(data, depth: int = 0):
    """The value that ``encode`` made ``data`` from; raises WireError for anything else."""
    if depth > MAX_DEPTH:
        raise WireError("nested too deeply")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(item, depth + 1) for item in data]
    if isinstance(data, dict) and len(data) == 1:
        (tag, body), = data.items()
        if tag == "__tuple__" and isinstance(body, list):
            return tuple(decode(item, depth + 1) for item in body)
        if tag == "__dict__" and isinstance(body, dict):
            return {str(key): decode(item, depth + 1) for key, item in body.items()}
        if tag == "__float__" and body in ("inf", "-inf", "nan"):
            return float(body)
        if tag == "__tensor__" and isinstance(body, dict):
            return _decode_tensor(body)
    raise WireError("data that is not an encoded value")


def _decode_tensor(body: dict) -> torch.Tensor:
    dtype, shape, data = body.get("dtype"), body.get("shape"), body.get("data")
    if not isinstance(dtype, str) or dtype not in _DTYPES or not isinstance(shape, list) or \
            not isinstance(data, str):
        raise WireError("a malformed tensor")
    if len(shape) > MAX_DIMS or not all(isinstance(n, int) and not isinstance(n, bool) and
                                        0 <= n < 2 ** 62 for n in shape):
        raise WireError("a tensor with a malformed shape")
    if len(data) > MAX_BYTES * 4 // 3 + 4:
        raise WireError("a tensor larger than the limit")
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise WireError("a tensor whose data is not base64") from None
    dtype = _DTYPES[dtype]
    numel = math.prod(shape)
    if len(raw) != numel * torch.empty((), dtype=dtype).element_size():
        raise WireError("a tensor whose data does not fit its shape")
    try:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
            torch.empty(0, dtype=torch.uint8)
        tensor = flat.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    except (RuntimeError, TypeError, ValueError, OverflowError):
        raise WireError("a tensor that cannot be built from its shape") from None
    tensor.grading_device = str(body.get("device", "cpu"))[:64]  # where the student's tensor was
    return tensor


# --- banned calls -------------------------------------------------------------------------------

def _resolve(dotted: str):
    """The object a dotted name ("torch.nn.functional.softmax") names, or None."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is None:
            try:
                module = __import__(".".join(parts[:split]), fromlist=["_"])
            except Exception:
                continue
        obj = module
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _code_of(obj):
    while hasattr(obj, "__wrapped__"):
        obj = obj.__wrapped__
    return getattr(obj, "__code__", None)


class Watch:
    """Records, from every thread, the banned calls made while it is armed.

    ``banned``: dotted names of functions ("torch.softmax", "torch.nn.functional.softmax"),
    methods of tensors ("torch.Tensor.softmax") or a whole package ("course_attn": any function
    defined in it). ``allowed``: dotted names of functions that may be called even so; whatever
    they call in turn is allowed too. ``report(text)`` is called at once for each new hit (the
    grader's copy writes it to a file the moment it happens).

    While armed, a profiler runs in the calling thread, in every thread that already exists
    (CPython 3.10 and later) and in every thread started through ``threading``; a thread started
    with ``_thread`` itself, which no profiler follows, is a hit. Switching the profiler off is a
    hit too: from Python (``sys.setprofile``), and when the watch finds itself switched off
    after the call. What the profiler cannot see: a C function that C code calls
    (``map(torch.softmax, ...)``, a ``functools.partial`` of one called inside the student's
    function); a torch function mode would, but it breaks ``torch.compile`` in the student's
    code, so the watch does without.
    """

    _SWITCHES = ("setprofile", "settrace")
    _THREAD_STARTERS = ("start_new_thread", "start_new", "start_joinable_thread")
    SWITCHED_OFF = "the profiler or the watch's own state, changed during the call " + \
        SWITCHES_OFF
    UNFOLLOWED_THREAD = "_thread.start_new_thread (a thread that the watch for banned calls " \
                        "cannot follow)"

    def __init__(self, banned=(), allowed=(), report=None):
        self.names = {}  # code object or builtin -> dotted name
        self.methods = {}  # tensor method name -> dotted name
        self.packages = []  # (directory, name)
        self.allowed_codes = set()
        self.hits = []
        self._report = report
        self.armed = False
        self._hook = self.hook  # one bound method, so that ``sys.getprofile() is`` it
        self._threads = {}  # thread state -> (its profile function, its profile object)
        self._failed = False
        for name in banned:
            self._ban(name)
        for name in allowed:
            code = _code_of(_resolve(name))
            if code is not None:
                self.allowed_codes.add(code)
        switches = [getattr(module, name + suffix) for module in (sys, threading)
                    for name in self._SWITCHES for suffix in ("", "_all_threads")
                    if hasattr(module, name + suffix)]
        self.switches = {id(s) for s in switches}  # C functions (sys's)
        self.switch_codes = {s.__code__: f"{s.__module__}.{s.__name__}" for s in switches
                             if hasattr(s, "__code__")}  # Python functions (threading's)
        import _thread
        self.thread_starters = {id(getattr(_thread, s)) for s in self._THREAD_STARTERS
                                if hasattr(_thread, s)}

    def _ban(self, name: str) -> None:
        if name.startswith("torch.Tensor."):
            attribute = name.rsplit(".", 1)[1]
            self.methods[attribute] = name  # a method written in C: seen as a bound builtin
            code = _code_of(getattr(torch.Tensor, attribute, None))
            if code is not None:  # a method written in Python (Tensor.backward)
                self.names[code] = name
            return
        obj = _resolve(name)
        if obj is None:
            return
        path = getattr(obj, "__path__", None)
        if path:  # a package
            self.packages.extend((os.path.join(p, ""), name) for p in path)
            return
        code = _code_of(obj)
        self.names[code if code is not None else obj] = name
        if code is None:
            self.names[id(obj)] = name

    def _banned_name(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code in self.switch_codes:
                return f"{self.switch_codes[code]} {SWITCHES_OFF}"
            name = self.names.get(code)
            if name is None and self.packages and code not in self.allowed_codes:
                for directory, package in self.packages:
                    if code.co_filename.startswith(directory):
                        qualname = getattr(code, "co_qualname", code.co_name)
                        module = frame.f_globals.get("__name__", package)
                        name = f"{module}.{qualname}"
                        break
            return name
        if event == "c_call":
            if id(arg) in self.switches:
                return f"{getattr(arg, '__module__', None) or 'sys'}.{arg.__name__} " + \
                    SWITCHES_OFF
            if id(arg) in self.thread_starters and not (
                    frame.f_code.co_filename == threading.__file__ and
                    getattr(threading, "_profile_hook", None) is self._hook):
                return self.UNFOLLOWED_THREAD
            name = self.names.get(id(arg))
            if name is None and self.methods and isinstance(getattr(arg, "__self__", None),
                                                            torch.Tensor):
                name = self.methods.get(getattr(arg, "__name__", None))
            return name
        return None

    def _allowed_caller(self, frame) -> bool:
        frame = frame.f_back
        while frame is not None:
            if frame.f_code in self.allowed_codes:
                return True
            frame = frame.f_back
        return False

    def _hit(self, name: str) -> None:
        if name not in self.hits:
            self.hits.append(name)
            if self._report is not None:
                self._report(name)

    def hook(self, frame, event, arg):
        if not self.armed or event not in ("call", "c_call") or \
                frame.f_code in _OWN_CODES:
            return
        try:
            name = self._banned_name(frame, event, arg)
            if name is None or self._allowed_caller(frame if event == "call" else
                                                   _FrameShim(frame)):
                return
            self._hit(name)
        except (KeyboardInterrupt, RecursionError, MemoryError):
            # An interrupt (the time limit), a recursion or memory error raised in here makes
            # CPython drop the profiler; that is no switching off by the submission.
            self._failed = True
            raise

    def check_target(self, target) -> None:
        """A hit if the exercise's function is itself a banned function (``stable_softmax =
        torch.softmax``, or a ``functools.partial`` or a decorated copy of one): the grader
        calls it from the watch's own frame, which the profiler does not watch."""
        import functools
        try:
            for _ in range(10):
                name = self._target_name(target)
                if name is not None:
                    self._hit(name)
                    return
                if isinstance(target, functools.partial):
                    target = target.func
                else:
                    target = getattr(target, "__wrapped__", None) or \
                        getattr(target, "__func__", None)
                if target is None:
                    return
        except Exception:  # an object that answers oddly is no banned function
            return

    def _target_name(self, target):
        code = getattr(target, "__code__", None)
        name = self.names.get(code) if code is not None else self.names.get(id(target))
        method = getattr(target, "__name__", None)
        if name is None and self.methods and isinstance(method, str) and (
                isinstance(getattr(target, "__self__", None), torch.Tensor) or
                getattr(torch.Tensor, method, None) is target):
            name = self.methods.get(method)
        return name

    def __enter__(self):
        self._failed = False
        self._previous = sys.getprofile()
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)
        self._threads = _profile_other_threads(self._hook)
        self.armed = True  # only now: setting the profilers up is no switching off
        return self

    def __exit__(self, *exc):
        switched_off = not self._failed and (self.armed is not True or
                                             sys.getprofile() is not self._hook)
        self.armed = False
        _unprofile_other_threads(self._hook, self._threads)
        self._threads = {}
        sys.setprofile(self._previous if self._previous is not self._hook else None)
        threading.setprofile(None)
        if switched_off:
            self._hit(self.SWITCHED_OFF)
        return False


# --- the profiler in threads that already run ---------------------------------------------------

class _ThreadState310(ctypes.Structure):  # the head of CPython 3.10's PyThreadState
    _fields_ = [("prev", ctypes.c_void_p), ("next", ctypes.c_void_p),
                ("interp", ctypes.c_void_p), ("frame", ctypes.c_void_p),
                ("recursion_depth", ctypes.c_int), ("recursion_headroom", ctypes.c_int),
                ("stackcheck_counter", ctypes.c_int), ("tracing", ctypes.c_int),
                ("cframe", ctypes.c_void_p), ("c_profilefunc", ctypes.c_void_p),
                ("c_tracefunc", ctypes.c_void_p), ("c_profileobj", ctypes.c_void_p),
                ("c_traceobj", ctypes.c_void_p)]


class _ThreadState311(ctypes.Structure):  # the head of CPython 3.11's PyThreadState
    _fields_ = [("prev", ctypes.c_void_p), ("next", ctypes.c_void_p),
                ("interp", ctypes.c_void_p), ("_initialized", ctypes.c_int),
                ("_static", ctypes.c_int), ("recursion_remaining", ctypes.c_int),
                ("recursion_limit", ctypes.c_int), ("recursion_headroom", ctypes.c_int),
                ("tracing", ctypes.c_int), ("tracing_what", ctypes.c_int),
                ("cframe", ctypes.c_void_p), ("c_profilefunc", ctypes.c_void_p),
                ("c_tracefunc", ctypes.c_void_p), ("c_profileobj", ctypes.c_void_p),
                ("c_traceobj", ctypes.c_void_p)]


def _c_api():
    """CPython's functions for walking thread states and setting their profiler, and the
    layout of a thread state; None where this is not CPython 3.10 or 3.11."""
    layout = {(3, 10): _ThreadState310, (3, 11): _ThreadState311}.get(sys.version_info[:2])
    if layout is None or sys.implementation.name != "cpython":
        return None
    try:
        api = ctypes.PyDLL(None)
        functions = {}
        for name, args in (("PyThreadState_Get", []), ("PyInterpreterState_Get", []),
                           ("PyInterpreterState_ThreadHead", [ctypes.c_void_p]),
                           ("PyThreadState_Next", [ctypes.c_void_p]),
                           ("_PyEval_SetProfile", [ctypes.c_void_p] * 3)):
            function = getattr(api, name)
            function.argtypes = args
            function.restype = ctypes.c_int if name == "_PyEval_SetProfile" else ctypes.c_void_p
            functions[name] = function
    except (AttributeError, OSError):
        return None
    return functions, layout


def _thread_states(api):
    state = api["PyInterpreterState_ThreadHead"](api["PyInterpreterState_Get"]())
    while state:
        yield state
        state = api["PyThreadState_Next"](state)


def _profile_other_threads(hook) -> dict:
    """Give every other thread of this interpreter the profiler ``hook`` (which this thread
    already has); returns what each had before, for ``_unprofile_other_threads``."""
    if hasattr(threading, "setprofile_all_threads"):  # Python 3.12 and later
        threading.setprofile_all_threads(hook)
        return {}
    found = _c_api()
    if found is None:
        return {}
    api, layout = found
    try:
        me = api["PyThreadState_Get"]()
        mine = layout.from_address(me)
        # The layout is right only if this thread's profiler is the hook just set.
        if mine.c_profileobj != id(hook) or mine.interp != api["PyInterpreterState_Get"]():
            return {}
        before = {}
        for state in _thread_states(api):
            if state == me:
                continue
            head = layout.from_address(state)
            old = ctypes.cast(head.c_profileobj, ctypes.py_object).value \
                if head.c_profileobj else None
            before[state] = (head.c_profilefunc, old)
            api["_PyEval_SetProfile"](state, mine.c_profilefunc, id(hook))
        return before
    except Exception:
        return {}


def _unprofile_other_threads(hook, before: dict) -> None:
    if hasattr(threading, "setprofile_all_threads"):
        threading.setprofile_all_threads(None)
        return
    found = _c_api()
    if found is None:
        return
    api, layout = found
    try:
        me = api["PyThreadState_Get"]()
        for state in _thread_states(api):
            head = layout.from_address(state)
            if state == me or head.c_profileobj != id(hook):
                continue
            function, old = before.get(state, (None, None))
            if old is None:
                function = None
            api["_PyEval_SetProfile"](state, function, None if old is None else id(old))
    except Exception:
        pass


class _FrameShim:
    """For a C call, the calling frame is the innermost Python frame: start the search there."""

    def __init__(self, frame):
        self.f_back = frame


# --- evaluating an exercise in the kernel --------------------------------------------------------

def error_as_data(error: BaseException) -> dict:
    """An exception as data: its type, message and the line of the student's code it came from."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if f.filename.startswith("<ipython-input") or
            f.filename.startswith("/tmp/ipykernel") or "ipykernel_" in f.filename]
    where = (mine or frames)[-1:] if frames else []
    return {"type": type(error).__name__, "message": str(error)[:2000],
            "line": where[0].lineno if where else None}


def evaluate(request_path: str, namespace: dict) -> None:
    """Run one exercise's cases as the grader asked in ``request_path`` (JSON), on the function
    or value that ``namespace`` (the notebook's globals) holds, and write the answer next to it.

    Request: ``{"name": "causal_mask", "kind": "function" | "value", "cases": [{"args": ...,
    "kwargs": ...}], "banned": [...], "allowed": [...], "hits": PATH, "answer": PATH}``.
    Answer: ``{"found": bool, "results": [{"value": ...} | {"error": {...}} | {"unencodable":
    "..."}, ...], "mutated": [[case, argument], ...], "banned": [names]}``. Banned calls are also
    appended to the ``hits`` file the moment they happen.
    """
    with open(request_path, encoding="utf-8") as file:
        request = json.load(file)
    hits_fd = os.open(request["hits"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def report(name):
        os.write(hits_fd, (json.dumps(name) + "\n").encode())

    answer = {"found": request["name"] in namespace, "results": [], "mutated": [], "banned": []}
    target = namespace.get(request["name"])
    watch = Watch(request.get("banned", ()), request.get("allowed", ()), report)
    if answer["found"] and request["kind"] != "value":
        watch.check_target(target)
    try:
        for number, case in enumerate(request["cases"] if answer["found"] else []):
            if request["kind"] == "value":
                result, args = target, []
            else:
                args, kwargs = decode(case["args"]), decode(case["kwargs"])
                before = json.dumps(encode(args), sort_keys=True)
                try:
                    with watch:
                        result = target(*args, **kwargs)
                except BaseException as error:  # the student's error is the answer to report
                    if isinstance(error, KeyboardInterrupt):
                        raise
                    answer["results"].append({"error": error_as_data(error)})
                    continue
                if json.dumps(encode(args), sort_keys=True) != before:
                    answer["mutated"].append([number, _changed_argument(args, before)])
            try:
                answer["results"].append({"value": encode(result)})
            except WireError as error:
                answer["results"].append({"unencodable": str(error)})
    finally:
        os.close(hits_fd)
    answer["banned"] = list(watch.hits)
    partial = request["answer"] + ".partial"
    with open(partial, "w", encoding="utf-8") as file:
        json.dump(answer, file)
    os.replace(partial, request["answer"])


def _changed_argument(args, before: str) -> int:
    """The index of the first argument whose encoding differs from the one in ``before``."""
    original = json.loads(before)
    for index, arg in enumerate(args):
        if index >= len(original) or encode(arg) != original[index]:
            return index
    return 0


def _own_codes() -> frozenset:
    """The code objects of this module's functions and methods (nested ones too): the watch's
    own frames, which it does not watch. By identity, not by file name, which any code can
    claim."""
    found, todo = set(), []
    for value in list(globals().values()):
        if isinstance(value, type) and value.__module__ == __name__:
            todo.extend(getattr(v, "__code__", None) for v in vars(value).values())
        todo.append(getattr(value, "__code__", None))
    while todo:
        code = todo.pop()
        if code is None or not hasattr(code, "co_consts") or code in found:
            continue
        if code.co_filename != _own_codes.__code__.co_filename:
            continue
        found.add(code)
        todo.extend(c for c in code.co_consts if hasattr(c, "co_consts"))
    return frozenset(found)


_OWN_CODES = _own_codes()
