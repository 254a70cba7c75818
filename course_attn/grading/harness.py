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
import json
import math
import os
import sys
import threading
import traceback

import torch

MAX_DEPTH = 32
MAX_BYTES = 64 * 1024 * 1024
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
        return value if math.isfinite(value) else {"__float__": repr(value)}
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
    if dtype not in _DTYPES or not isinstance(shape, list) or not isinstance(data, str):
        raise WireError("a malformed tensor")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
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
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
        torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    tensor.grading_device = str(body.get("device", "cpu"))  # where the student's tensor was
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
    """

    _SWITCHES = ("setprofile", "settrace")

    def __init__(self, banned=(), allowed=(), report=None):
        self.names = {}  # code object or builtin -> dotted name
        self.methods = {}  # tensor method name -> dotted name
        self.packages = []  # (directory, name)
        self.allowed_codes = set()
        self.hits = []
        self._report = report
        self.armed = False
        for name in banned:
            self._ban(name)
        for name in allowed:
            code = _code_of(_resolve(name))
            if code is not None:
                self.allowed_codes.add(code)
        switches = [getattr(sys, s) for s in self._SWITCHES] + \
            [getattr(threading, s) for s in self._SWITCHES]
        self.switches = {id(s) for s in switches}

    def _ban(self, name: str) -> None:
        if name.startswith("torch.Tensor."):
            self.methods[name.rsplit(".", 1)[1]] = name
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
                return f"{getattr(arg, '__module__', None) or 'sys'}.{arg.__name__} (it " \
                       "switches off the watch for banned calls)"
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

    def hook(self, frame, event, arg):
        if not self.armed or event not in ("call", "c_call") or \
                frame.f_code.co_filename == _OWN_FILE:
            return
        name = self._banned_name(frame, event, arg)
        if name is None or self._allowed_caller(frame if event == "call" else
                                               _FrameShim(frame)):
            return
        if name not in self.hits:
            self.hits.append(name)
            if self._report is not None:
                self._report(name)

    def __enter__(self):
        self.armed = True
        self._previous = sys.getprofile()
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc):
        self.armed = False
        sys.setprofile(self._previous if self._previous is not self.hook else None)
        threading.setprofile(None)
        return False


_OWN_FILE = globals().get("__file__", "<course_attn-harness>")  # the watch's own frames


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
