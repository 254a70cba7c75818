"""What runs inside the student's kernel: values as plain data, the guard that checks every
operation the student's function runs, and the evaluation of one exercise on the grader's inputs.

The grader never trusts this code's verdict, because there is none here: the kernel computes the
student's outputs for the grader's inputs and sends them back as data; the grader compares them
with references it computes itself (``judge.py``). What this module adds is the guard, which must
run where the student's function runs.

The module is self-contained (standard library and torch only): the grader sends its source to
each kernel and installs it there (``install``) before any cell of the submission runs, rather
than importing the kernel's copy of the package. ``check()`` imports it in-process.

Plain data (``encode`` / ``decode``): None, bool, int, float, str, lists, tuples, dicts with
string keys, and tensors as ``{"__tensor__": {dtype, shape, device, data (base64 of the raw
bytes)}}``. Only torch's own tensor class is sent, read without running any code of the
submission (no ``__torch_function__``, no mode); nothing is ever unpickled or executed on
decoding.
"""

import base64
import ctypes
import gc
import json
import math
import os
import sys
import threading
import traceback

import torch
import torch.overrides
import torch.utils._python_dispatch

MAX_DEPTH = 32
MAX_BYTES = 64 * 1024 * 1024
MAX_DIMS = 64
SWITCHES_OFF = "(it switches off the check of the operations it runs)"  # ends such a hit
COPY_OF = "a copy of "  # starts a hit that copied an argument the exercise forbids copying
TABLE_OF = "a whole table of scores "  # starts a hit that made a (Tq, Tk) tensor where tiles do
READ_AGAIN = "a second read of "  # starts a hit that read an argument meant to be read once
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)}


class WireError(ValueError):
    """A value that is not plain data, or data that does not decode."""


def encode(value, depth: int = 0):
    """``value`` as JSON-compatible plain data; raises WireError for anything else. Numbers,
    strings and tuples of a subclass are read through their base class, so no method of the
    submission's runs; a tensor must be torch's own (``torch.Tensor``, ``nn.Parameter``)."""
    if depth > MAX_DEPTH:
        raise WireError("nested too deeply")
    if value is None or type(value) is bool:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int.__int__(value)
    if isinstance(value, float):
        value = float.__float__(value)
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return {"__tensor__": _encode_tensor(value)}
    if type(value) is list or isinstance(value, tuple):
        items = [encode(item, depth + 1) for item in (list.__iter__(value) if type(value) is list
                                                      else tuple.__iter__(value))]
        return items if type(value) is list else {"__tuple__": items}
    if type(value) is dict:
        keys = list(dict.keys(value))
        if not all(type(key) is str for key in keys):
            raise WireError("a dict whose keys are not all strings")
        return {"__dict__": {key: encode(dict.__getitem__(value, key), depth + 1)
                             for key in keys}}
    number = _numpy_number(value)
    if number is not None:
        return encode(number, depth)
    raise WireError(f"a value of type {type(value).__name__}")


def _numpy_number(value):
    """A numpy scalar (``numpy.int64``, ``numpy.float32``, ``numpy.bool_``...) or 0-d array of
    one, as the Python number it holds; None for anything else. A number is a number, however
    it was computed (``np.prod`` gives a numpy.int64). Only numpy's own types are read, by
    numpy's own method, so no method of the submission's runs."""
    numpy = sys.modules.get("numpy")  # a numpy value means numpy was imported
    if numpy is None:
        return None
    if type(value) in numpy.sctypeDict.values() and \
            issubclass(type(value), (numpy.bool_, numpy.integer, numpy.floating)):
        return numpy.generic.item(value)
    if type(value) is numpy.ndarray and value.ndim == 0 and value.dtype.kind in "biuf":
        return numpy.ndarray.item(value)
    return None


def _encode_tensor(value: torch.Tensor) -> dict:
    """A tensor's dtype, shape, device and bytes, read with every torch mode and
    ``__torch_function__`` of the submission switched off."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        tensor = value.detach()
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise WireError(f"a tensor of dtype {tensor.dtype}")
        device = str(tensor.device)
        flat = torch.empty(tensor.numel(), dtype=tensor.dtype)  # fresh strides, even for one
        flat.copy_(tensor.to("cpu").reshape(-1))                 # element of stride 6
        raw = flat.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        shape = list(tensor.shape)
    return {"dtype": name, "shape": shape, "device": device,
            "data": base64.b64encode(raw).decode("ascii")}


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


# --- the guard: every operation the student's function runs, checked where torch dispatches ------

SWITCHED_OFF = "torch's modes popped off their stacks, or the guard disarmed, during the " \
    "call " + SWITCHES_OFF
PROFILER_REPLACED = "sys.setprofile: the profiler that checks an arithmetic exercise, replaced " \
    "during the call (profile it outside the graded function) " + SWITCHES_OFF
UNSEEN = "a tensor computed where the guard saw no operation at all (torch's dispatch hidden " \
    "from it, as by excluding a dispatch key) " + SWITCHES_OFF
_ALLOWED = object()  # what ``Guard._place`` answers inside an allowed function


def _made_during_the_call(result, args, kwargs) -> bool:
    """Whether ``result`` is, or holds at its top level, a tensor that is none of the arguments
    and whose object was made during the call: objects that lived before it were frozen
    (``gc.freeze``, in ``Guard.call``), so the collector lists only those made since. A tensor
    kept from before the call (a cache, a table) passes; a new one does, whatever else holds
    it (a global list too)."""
    given = {id(value) for value in (*args, *kwargs.values())}
    if type(result) in (list, tuple):
        values = list(result)
    elif type(result) is dict:
        values = list(dict.values(result))
    else:
        values = [result]
    # issubclass of the type, not isinstance: isinstance may read a submission's __class__
    tensors = {id(v) for v in values if issubclass(type(v), torch.Tensor) and id(v) not in given}
    return bool(tensors) and any(id(o) in tensors for o in gc.get_objects())


def function_name(func) -> str:
    """The name a student knows a torch function by: ``torch.softmax``, ``Tensor.softmax``,
    ``torch.nn.functional.rms_norm``, ``torch.ops.aten._softmax.default``."""
    if type(func).__name__ in ("OpOverload", "OpOverloadPacket"):
        return f"torch.ops.{func}"
    module = getattr(func, "__module__", None) or "torch"
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or \
        type(func).__name__
    if qualname.startswith(("TensorBase.", "_TensorBase.")) or \
            getattr(func, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase):
        return "torch.Tensor." + qualname.rsplit(".", 1)[-1]
    qualname = qualname.removeprefix("_VariableFunctionsClass.")
    public = _PUBLIC_MODULES.get(module)
    if public is not None:
        module, qualname = public, qualname.removeprefix(public.rsplit(".", 1)[-1] + "_")
    return f"{module}.{qualname}"


_PUBLIC_MODULES = {"torch._C._special": "torch.special", "torch._C._nn": "torch.nn.functional",
                   "torch._C._linalg": "torch.linalg", "torch._C._fft": "torch.fft",
                   "torch._C._VariableFunctions": "torch"}


def _stem(name: str) -> str:
    """The operation a function name stands for, whatever the route:
    ``torch.ops.aten._softmax.default``, ``torch._softmax`` and ``torch.Tensor.softmax`` all
    give ``softmax``;
    ``torch.special.log_softmax`` gives ``log_softmax``."""
    if name.startswith("torch.ops."):
        parts = name.split(".")
        name = parts[3] if len(parts) > 3 else parts[-1]
    else:
        name = name.rsplit(".", 1)[-1]
    name = name.lstrip("_")
    for prefix in ("special_", "linalg_", "nn_"):
        name = name.removeprefix(prefix)
    return name.removesuffix("_")


# A refused stem refuses its whole family: every operation whose name holds one of these
# words, whatever comes before or after it (``_safe_softmax``, ``_softmax_backward_data``,
# ``_scaled_dot_product_flash_attention_for_cpu``, ``_efficient_attention_forward``,
# ``_fused_sdp_choice``).
_SOFTMAX_FAMILY = ("softmax", "logsumexp")
_ATTENTION_FAMILY = ("scaled_dot_product", "flash_attention", "efficient_attention",
                     "cudnn_attention", "fused_sdp", "sdpa")
_FAMILIES = {"softmax": _SOFTMAX_FAMILY, "log_softmax": _SOFTMAX_FAMILY,
             "logsumexp": _SOFTMAX_FAMILY, "scaled_dot_product_attention": _ATTENTION_FAMILY}


def _refuses(stems: frozenset, name: str) -> bool:
    stem = _stem(name)
    return stem in stems or any(stem.startswith(s + "_") for s in stems) or \
        any(word in stem for s in stems for word in _FAMILIES.get(s, ()))


class _Functions(torch.overrides.TorchFunctionMode):
    """Sees each torch function the student calls, by the name the student used."""

    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        guard, name = self.guard, function_name(func)
        outermost = guard._enter_function(name)
        try:
            if guard.armed and outermost:
                guard._check_function(name)
            return func(*args, **(kwargs or {}))
        finally:
            guard._leave_function(outermost)


class _Operations(torch.utils._python_dispatch.TorchDispatchMode):
    """Sees each ATen operation that torch dispatches, however the student reached it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in the torch._dynamo.disable it finds at the first
        # call: a submission that replaced it first would blind the guard, and the import costs
        # each graded kernel a second. Graded calls run with the compiler's stance set to
        # "force_eager" (_compile_stance), so no compiler traces this frame.
        return False

    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        guard = self.guard
        if guard.armed:
            guard._check_operation(func)
        out = func(*args, **(kwargs or {}))
        if guard.armed:  # what the exercise declares of how an answer computes (Guard)
            if guard._protected:
                guard._check_copy(func, args, kwargs or {}, out)
            if guard._table:
                guard._check_table(func, out)
            if guard._once:
                guard._check_reads(func, args, kwargs or {}, out)
            if guard._feeds:
                guard._check_feeds(func, args, kwargs or {}, out)
        return out


def _tensors(value) -> list:
    """The tensors in an operation's arguments or results (nested in lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _storage(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _watched(arguments, args) -> dict:
    """Storage -> [name, elements, counted so far] of the tensors among ``args`` that
    ``arguments`` ((position, name)) names."""
    return {_storage(args[position]): [name, args[position].numel(), 0]
            for position, name in arguments
            if position < len(args) and type(args[position]) is torch.Tensor}


def _table(positions, args):
    """The (Tq, Tk) and (Tk, Tq) shapes a tiled call may not make, from the positions of q, k
    and the block size in ``args``; None where no rule applies (a block of queries or of keys
    holds them all, so a tile may be as large as the table)."""
    if not positions or max(positions) >= len(args):
        return None
    q, k, block = (args[p] for p in positions)
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or q.dim() < 2 or \
            k.dim() < 2 or isinstance(block, bool) or not isinstance(block, int):
        return None
    tq, tk = q.shape[-2], k.shape[-2]
    return {(tq, tk), (tk, tq)} if min(tq, tk) > block else None


# A product's multiply-adds: its first matrix operand's size times the second's last axis
# (mm, bmm, mv, dot and their add- forms), by where the first operand sits in its arguments.
_PRODUCTS = {"aten.mm": 0, "aten.bmm": 0, "aten.mv": 0, "aten.dot": 0, "aten.vdot": 0,
             "aten.addmm": 1, "aten.baddbmm": 1, "aten.addbmm": 1, "aten.addmv": 1}


def _work(func, args, kwargs, out) -> int:
    """An operation's work: the multiply-adds of a matrix product, else the elements it
    writes."""
    op = str(func.overloadpacket).removesuffix("_")
    first = _PRODUCTS.get(op)
    if first is not None and len(args) > first + 1 and \
            all(type(t) is torch.Tensor for t in args[first:first + 2]):
        a, b = args[first:first + 2]
        return a.numel() * (b.shape[-1] if b.dim() >= 2 else 1)
    return sum(t.numel() for t in _written(func, args, kwargs, out))


def _written(func, args, kwargs, out) -> list:
    """The tensors an operation writes: ``out=``, the first argument of an in-place one, else
    what it returns."""
    written = _tensors(kwargs.get("out"))
    if not written and str(func.overloadpacket).endswith("_"):
        written = _tensors(args[:1])
    return written or _tensors(out)


class _Feeds:
    """What a cached generation runs through the weights that make what its cache keeps (its
    keys and values): ``feeds`` = (position of the weights, a dict; their keys; position of
    the prompt, token ids; position of the count of new tokens n). The prefill runs the P
    tokens of the prompt through them, and each later step its one new token, the last one
    never: P + n - 1 tokens in all, whatever copies the loop makes of the prompt or of the
    tokens it chose. One that runs more computes a token's key again, which its cache holds.

    Measured in multiply-adds against the weights: a product with one of them (or with a copy:
    whatever an operation makes from the weights alone, a clone, a transpose made contiguous,
    a stack, an einsum's reshape) costs a token's worth per row of the other operand, so the
    whole call may spend (P + n - 1) times the weights' size. Any other operation of a weight
    with another tensor (an elementwise product) costs the elements it writes. Copies are kept
    until the call ends, so no later tensor takes their memory (storages are told apart by
    address). Not seen: a copy made outside torch's dispatch (``tolist``, NumPy's copy)."""

    def __init__(self, feeds, args):
        position, keys, prompt, count = feeds
        weights, tokens, n = (args[p] if p < len(args) else None
                              for p in (position, prompt, count))
        found = [weights.get(key) for key in keys] if type(weights) is dict else []
        if not found or any(type(w) is not torch.Tensor or not w.numel() for w in found) or \
                type(tokens) is not torch.Tensor or type(n) is not int:
            self.budget = None
            return
        self.names = " and ".join(keys)
        self.prompt, self.new = tokens.numel(), n
        self.tokens = self.prompt + n - 1
        self.size = sum(w.numel() for w in found)
        self.budget = self.tokens * self.size
        self.storages = {_storage(w) for w in found}
        self.copies = []  # the copies, alive until the call ends
        self.spent = 0

    def after(self, func, args, kwargs, out) -> bool:
        """Count one operation; True the first time the call has spent more than its budget."""
        written = _written(func, args, kwargs, out)
        read = [t for t in _tensors((args, kwargs)) if not any(t is w for w in written)]
        if not any(t.numel() and _storage(t) in self.storages for t in read):
            return False
        op = str(func.overloadpacket)
        if op.endswith("_like") or op.startswith("aten.new_"):
            return False  # reads the weights' shape, not their values
        if not any((t.is_floating_point() or t.is_complex()) and t.numel() > 1 and
                   _storage(t) not in self.storages for t in read):
            for t in written:  # made from the weights alone: a copy of them
                if t.numel():
                    self.storages.add(_storage(t))
                    self.copies.append(t)
            return False
        before, self.spent = self.spent, self.spent + _work(func, args, kwargs, out)
        return before <= self.budget < self.spent

    def why(self, route: str) -> str:
        """The hit, the route last (the grader keeps a hit's first 200 characters); ``judge``
        reads it as: reads the earlier tokens (more than ...) a second time, in ``route``."""
        return (f"{READ_AGAIN}the earlier tokens (more than the {self.tokens} a cached "
                f"generation runs through {self.names}, {self.prompt} of the prompt and "
                f"{self.new - 1} new): {route}")


class Guard:
    """Checks, while armed (``with guard:``), every operation the student's function makes.

    ``ops``: the ATen operations (``"aten.mul"``, ``"aten._softmax"``, by overload packet) the
    function may run; any other is a hit, named by the torch function the student called
    (``torch.special.log_softmax (it runs aten._log_softmax)``). None: any operation.
    ``refused``: functions refused by name whatever route reaches them (``"rms_norm"`` refuses
    ``torch.nn.functional.rms_norm``, ``torch.rms_norm`` and ``torch.ops.aten.rms_norm``):
    the shortcuts that torch decomposes into allowed operations before they are dispatched.
    ``functions``: Python functions refused by where their code is ((file, qualified name,
    the name to report)), such as ``torch.nn.attention.bias.causal_lower_right``: any torch
    operation while one of them is on the stack is a hit. ``package``: a folder (the copy of
    ``course_attn`` the kernel imports): running code defined in a file in it is a hit, named
    ``course_attn.masks.causal_mask``, unless the function is one of ``allowed`` ((file
    relative to the package, qualified name)): whatever an allowed function runs is allowed.
    ``report(name)`` is called at once for each new hit. ``no_copy``: ((argument position,
    name)) of tensors the function must read where they are (grouped attention's K and V):
    once operations that read only that argument have written as many elements as it holds
    (a clone, a reshape of its expanded view, a stack of its heads, a copy_ from it), that is
    a hit, ``a copy of k: torch.Tensor.reshape (it runs aten.clone)``. ``no_table``: (position
    of q, of k, of the block size) for a tiled computation: a tensor whose last two axes are
    (Tq, Tk), or (Tk, Tq), is a hit where tiles are smaller than that (Tq and Tk above the block).
    ``read_once``: ((position, name)) of arguments a one-pass computation reads once: once the
    operations that read them (views excepted) have read more elements than one holds, that is
    a hit, ``a second read of k: torch.Tensor.__matmul__ (it runs aten.mm)``. ``feeds``:
    (position of the weights, a dict; the keys of those that compute what a cache keeps;
    position of the prompt; position of the count of new tokens n) of a cached generation:
    running more than P + n - 1 tokens through those weights is a hit, ``a second read of the
    earlier tokens: ...`` (``_Feeds``).

    Where the function may run no operation at all (``ops`` empty: an answer worked out with
    arithmetic), a profiler in the calling thread also sees the package's Python code that
    touches no tensor.

    Both checks are torch modes, which torch keeps per thread: they are pushed in the calling
    thread, in every thread started through ``threading`` while the guard is armed, and in
    every thread already running, the next time it runs Python code (``_visit_other_threads``).
    What they cannot see: a thread that ``_thread`` started during the call, a process, and a
    submission that pops the modes off torch's stacks or hides torch's dispatch from them (an
    excluded dispatch key), which is reported when found after the call; and a tensor answer
    made while the guard saw no operation at all (all the work done where it cannot see) is a
    hit of its own (``call``).
    """

    @classmethod
    def from_options(cls, options: dict, report=None) -> "Guard":
        """The guard that ``operations.guard_options`` (as plain data: a grader's request, or
        ``check()``'s options) asks for."""
        def pairs(key):
            return [tuple(item) for item in options.get(key, ())]
        return cls(options.get("ops"), options.get("refused", ()), options.get("package"),
                   pairs("allowed"), report, pairs("functions"), pairs("no_copy"),
                   options.get("no_table"), pairs("read_once"), options.get("feeds"))

    def __init__(self, ops=None, refused=(), package=None, allowed=(), report=None,
                 functions=(), no_copy=(), no_table=None, read_once=(), feeds=None):
        self.ops = None if ops is None else frozenset(ops)
        self.no_copy = tuple((int(position), str(name)) for position, name in no_copy)
        self._protected = {}  # in the current call: storage -> [name, elements, copied so far]
        self.no_table = tuple(int(p) for p in no_table) if no_table else None
        self._table = None  # in the current call: the forbidden last two axes
        self.read_once = tuple((int(position), str(name)) for position, name in read_once)
        self._once = {}  # in the current call: storage -> [name, elements, read so far]
        self.feeds = None if not feeds else (int(feeds[0]), tuple(str(k) for k in feeds[1]),
                                             int(feeds[2]), int(feeds[3]))
        self._feeds = None  # in the current call: a _Feeds
        self.refused = frozenset(_stem(name) for name in refused)
        self.functions = {(file, qualname): name for file, qualname, name in functions}
        self.packages = ()
        if package:
            self.packages = tuple({os.path.join(p, "") for p in (package,
                                                                   os.path.realpath(package))})
        self.allowed = frozenset((os.path.join(p, file), qualname) for p in self.packages
                                 for file, qualname in allowed)
        self.hits = []
        self.operations_seen = 0  # in the current call
        self._settled = False  # a call of the package was seen: nothing more can change the verdict
        self._report = report
        self._local = threading.local()
        self.armed = False

    # the outermost torch function the student called, per thread
    def _enter_function(self, name) -> bool:
        if getattr(self._local, "function", None) is None:
            self._local.function = name
            return True
        return False

    def _leave_function(self, outermost: bool) -> None:
        if outermost:
            self._local.function = None

    def _hit(self, name: str) -> None:
        if name not in self.hits:
            self.hits.append(name)
            if self._report is not None:
                self._report(name)
        # The reason names the package's call first: once one is seen, the checks of the
        # operations that follow (a stack walk each) can only cost time.
        self._settled = self._settled or name.startswith("course_attn.")

    def _place(self, frame=None):
        """_ALLOWED inside an allowed function of the package; else the name of the outermost
        refused function (of the package, or of ``functions``) on the stack from ``frame``
        (the caller of the torch mode that asks); else None."""
        if not self.packages and not self.functions:
            return None
        frame, found = frame or sys._getframe(3), None
        while frame is not None and frame.f_code is not _CALL_CODE:
            code = frame.f_code
            place = (code.co_filename, getattr(code, "co_qualname", code.co_name))
            if place in self.functions:
                found = self.functions[place]
            elif self.packages and place[0].startswith(self.packages) and \
                    place[0] != _OWN_FILE:
                if place in self.allowed:
                    return _ALLOWED
                found = _package_name(*place)
            frame = frame.f_back
        return found

    def _check_function(self, name: str) -> None:
        if self._settled:
            return
        place = self._place()
        if place is _ALLOWED:
            return
        if place is not None:
            self._hit(place)
        elif self.refused and _refuses(self.refused, name):
            self._hit(name)

    def _check_operation(self, func) -> None:
        self.operations_seen += 1
        if self._settled:
            return
        place = self._place()
        if place is _ALLOWED:
            return
        if place is not None:
            self._hit(place)
            return
        op = str(getattr(func, "overloadpacket", func))
        if self.ops is not None and op not in self.ops:
            self._hit(self._route(op))

    def _route(self, op: str) -> str:
        """``op`` named by the torch function the student called, where one was seen:
        ``torch.Tensor.reshape (it runs aten.clone)``."""
        called = getattr(self._local, "function", None)
        return f"{called} (it runs {op})" if called else op

    def _check_copy(self, func, args, kwargs, out) -> None:
        """After an operation, while a ``no_copy`` argument is guarded: count what it wrote
        from that argument alone (an in-place operation writes its first argument, or ``out``)."""
        written = _written(func, args, kwargs, out)
        read = [t for t in _tensors((args, kwargs)) if not any(t is w for w in written)]
        sources = {_storage(t) for t in read if t.is_floating_point() or t.is_complex()}
        if len(sources) != 1 or (source := sources.pop()) not in self._protected:
            return
        count = self._protected[source]
        copied = sum(t.numel() for t in written if _storage(t) != source)
        count[2] += copied
        if copied and count[2] >= count[1] > 0 and count[2] - copied < count[1]:
            self._hit(f"{COPY_OF}{count[0]}: {self._route(str(func.overloadpacket))}")

    def _check_table(self, func, out) -> None:
        for tensor in _tensors(out):
            if tensor.dim() >= 2 and tuple(tensor.shape[-2:]) in self._table:
                rows, cols = tensor.shape[-2:]
                self._hit(f"{TABLE_OF}({rows}, {cols}): {self._route(str(func.overloadpacket))}")
                return

    def _check_reads(self, func, args, kwargs, out) -> None:
        made = {_storage(t) for t in _tensors(out)}
        for tensor in _tensors((args, kwargs)):
            storage = _storage(tensor)
            count = self._once.get(storage)
            if count is None or storage in made:
                continue
            count[2] += tensor.numel()
            if count[2] > count[1] >= count[2] - tensor.numel():
                self._hit(f"{READ_AGAIN}{count[0]}: {self._route(str(func.overloadpacket))}")

    def _check_feeds(self, func, args, kwargs, out) -> None:
        if self._feeds.after(func, args, kwargs, out):
            self._hit(self._feeds.why(self._route(str(func.overloadpacket))))

    def call(self, target, args, kwargs):
        """``target(*args, **kwargs)`` under the guard (its frame ends the stack walks).

        A tensor answer that is none of the arguments cannot be made without an operation: if
        the guard saw none, torch's dispatch was hidden from it (a dispatch key excluded around
        the work), and that is a hit, whether or not something else holds it; a tensor kept
        from before the call (a cache) is not."""
        self.operations_seen = 0
        self._protected = _watched(self.no_copy, args)
        self._table = _table(self.no_table, args)
        self._once = _watched(self.read_once, args)
        feeds = _Feeds(self.feeds, args) if self.feeds else None
        self._feeds = feeds if feeds is not None and feeds.budget is not None else None
        gc.freeze()  # what lives now is old: only objects made by the call are listed after it
        try:
            with _compile_stance(), self:
                result = target(*args, **kwargs)
            if self.ops and self.operations_seen == 0 and \
                    _made_during_the_call(result, args, kwargs):
                self._hit(UNSEEN)
        finally:
            gc.unfreeze()
            self._feeds = None  # and the copies it kept
        return result

    def _visit(self) -> None:
        """In another thread: take off the modes of guards that are done, then (while this
        guard is armed) put this guard's on."""
        for stack, pop in ((_function_modes, torch._C._pop_torch_function_stack),
                           (_dispatch_modes, _pop_dispatch_mode)):
            while stack() and isinstance(stack()[-1], (_Functions, _Operations)) and \
                    not stack()[-1].guard.armed:
                pop()
        if threading.get_ident() != self._caller:
            _RAN_PYTHON.add(threading.get_native_id())
            if self.armed:
                for mode in (_Functions(self), _Operations(self)):
                    mode.__enter__()

    def _calls(self, frame, event, arg):
        """A profiler for an exercise that runs no torch operation at all (arithmetic): the
        package's Python code is seen where it is called, torch or not."""
        if event == "call" and self.armed and not self._settled and \
                frame.f_code.co_filename.startswith(self.packages):
            place = self._place(frame)
            if place is not None and place is not _ALLOWED:
                self._hit(place)

    def __enter__(self):
        self._modes = (_Functions(self), _Operations(self))
        for mode in self._modes:
            mode.__enter__()
        self._caller = threading.get_ident()
        self._watch_calls = bool(self.packages) and self.ops is not None and not self.ops
        if self._watch_calls:
            self._calls_hook, self._previous_profile = self._calls, sys.getprofile()
            sys.setprofile(self._calls_hook)
        self._start = threading.Thread.start
        guard = self

        def start(thread, *a, **k):  # a thread started meanwhile runs under the same modes
            run = thread.run

            def guarded_run():
                functions, operations = _Functions(guard), _Operations(guard)
                functions.__enter__()
                operations.__enter__()
                try:
                    run()
                finally:  # the guard's end may have taken them off already (_visit)
                    _take_off(functions, operations)
            thread.run = guarded_run
            return guard._start(thread, *a, **k)
        threading.Thread.start = start
        self._kernels = _watch_kernels(self) if self.packages else []
        self.armed = True
        _visit_other_threads(self._visit)
        return self

    def __exit__(self, *exc):
        if self.armed is not True:  # the submission reached the guard and disarmed it
            self._hit(SWITCHED_OFF)
        self.armed = False
        if self._watch_calls:
            # An interrupt (the time limit) that lands inside the profiler makes CPython drop it:
            # not the submission's doing.
            interrupted = bool(exc) and isinstance(exc[1], KeyboardInterrupt)
            if sys.getprofile() is not self._calls_hook and not interrupted:
                self._hit(PROFILER_REPLACED)
            _restore_profiler(self._previous_profile)
        threading.Thread.start = self._start
        for cls, name, original in self._kernels:
            setattr(cls, name, original)
        _visit_other_threads(self._visit)  # each takes this guard's modes off again
        functions, operations = self._modes
        if _top_dispatch_mode() is not operations or _top_function_mode() is not functions:
            self._hit(SWITCHED_OFF)
        _take_off(functions, operations)
        return False


def _take_off(functions, operations) -> None:
    """Take a guard's two modes off torch's stacks, wherever they are in them (the modes above
    kept in order), and only if they are still there: a mode left behind would slow every later
    torch call of the process (check() in a notebook, a test)."""
    for mode, stack, pop, push in (
            (operations, _dispatch_modes, _pop_dispatch_mode,
             torch.utils._python_dispatch._push_mode),
            (functions, _function_modes, torch._C._pop_torch_function_stack,
             torch._C._push_on_torch_function_stack)):
        if not any(entry is mode for entry in stack()):
            continue
        above = []
        while stack()[-1] is not mode:
            above.append(stack()[-1])
            pop()
        mode.__exit__(None, None, None)
        for entry in reversed(above):
            push(entry)


def _dispatch_modes() -> list:
    return torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def _function_modes() -> list:
    return torch.overrides._get_current_function_mode_stack()


def _pop_dispatch_mode() -> None:
    torch.utils._python_dispatch._pop_mode()


def _top_dispatch_mode():
    stack = _dispatch_modes()
    return stack[-1] if stack else None


def _top_function_mode():
    stack = _function_modes()
    return stack[-1] if stack else None


# --- running code once in every other thread -----------------------------------------------------

def _visit_other_threads(visit) -> None:
    """Have every other thread of this interpreter call ``visit()`` once, the next time it runs
    Python code: a one-shot profiler, which first puts that thread's own profiler back. (Torch
    keeps its modes per thread; a thread the submission started before the call, such as a
    pool's worker, would otherwise run unchecked.) Through CPython's C API, on each thread's
    state: Python has no call that reads another thread's profiler (3.12's
    ``threading.setprofile_all_threads`` only overwrites them all). On an interpreter whose
    thread state this code does not know, every other thread's profiler is set and cleared."""
    found = _c_api()
    if found is None:
        if hasattr(threading, "setprofile_all_threads"):
            mine, for_new_threads = sys.getprofile(), threading.getprofile()

            def once(frame, event, arg):
                sys.setprofile(None)
                visit()
            threading.setprofile_all_threads(once)
            threading.setprofile(for_new_threads)
            _restore_profiler(mine)
        return
    api, layout = found
    mine = sys.getprofile()
    try:
        def probe(frame, event, arg):
            return None
        sys.setprofile(probe)
        me = api["PyThreadState_Get"]()
        head = layout.from_address(me)
        if head.c_profileobj != id(probe) or head.interp != api["PyInterpreterState_Get"]():
            return  # not the layout this code knows
        trampoline = head.c_profilefunc
        for state in _thread_states(api):
            if state == me:
                continue
            other = layout.from_address(state)
            before = (other.c_profilefunc, ctypes.cast(other.c_profileobj, ctypes.py_object).value
                      if other.c_profileobj else None)

            def once(frame, event, arg, before=before):
                function, profiler = before
                if profiler is None or function == trampoline:
                    sys.setprofile(profiler)
                else:  # a profiler written in C (cProfile): put it back as it was
                    api["_PyEval_SetProfile"](api["PyThreadState_Get"](), function,
                                              id(profiler))
                visit()
            _KEEP.append(once)
            api["_PyEval_SetProfile"](state, trampoline, id(once))
    except Exception:
        pass
    finally:
        _restore_profiler(mine)


def _restore_profiler(saved) -> None:
    """Make ``saved`` (what ``sys.getprofile()`` returned) this thread's profiler again. A
    profiler written in C, such as cProfile's that a notebook left enabled, is returned as its
    object, which is not callable: ``sys.setprofile`` would install it as a Python function
    that fails at the next call, so it is put back by its own C method (the base class's, never
    a method the submission wrote)."""
    import _lsprof
    if isinstance(saved, _lsprof.Profiler):
        _lsprof.Profiler.enable(saved)
    else:
        sys.setprofile(saved)


def _thread_state(version: str, *middle: str):
    """The head of CPython ``version``'s PyThreadState, as far as the profiler fields: three
    pointers (prev, next, interp), then ``middle`` ("name:type", type p, i or u for pointer,
    int, unsigned), then the profile and trace functions and objects. Checked at run time by a
    probe profiler, so a wrong layout is never used."""
    types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "u": ctypes.c_uint}
    fields = [(name, types[kind]) for name, kind in (m.split(":") for m in middle)]
    pointers = [(name, ctypes.c_void_p) for name in ("prev", "next", "interp")]
    profile = [(name, ctypes.c_void_p) for name in ("c_profilefunc", "c_tracefunc",
                                                    "c_profileobj", "c_traceobj")]
    return type(f"_ThreadState{version}", (ctypes.Structure,),
                {"_fields_": pointers + fields + profile})


_THREAD_STATES = {
    (3, 10): _thread_state("310", "frame:p", "recursion_depth:i", "recursion_headroom:i",
                           "stackcheck_counter:i", "tracing:i", "cframe:p"),
    (3, 11): _thread_state("311", "_initialized:i", "_static:i", "recursion_remaining:i",
                           "recursion_limit:i", "recursion_headroom:i", "tracing:i",
                           "tracing_what:i", "cframe:p"),
    (3, 12): _thread_state("312", "_status:u", "py_recursion_remaining:i",
                           "py_recursion_limit:i", "c_recursion_remaining:i",
                           "recursion_headroom:i", "tracing:i", "what_event:i", "cframe:p"),
    (3, 13): _thread_state("313", "eval_breaker:p", "_status:u", "_whence:i", "state:i",
                           "py_recursion_remaining:i", "py_recursion_limit:i",
                           "c_recursion_remaining:i", "recursion_headroom:i", "tracing:i",
                           "what_event:i", "current_frame:p"),
}


def _c_api():
    """CPython's functions for walking thread states and setting their profiler, and the
    layout of a thread state; None where this is not CPython 3.10 to 3.13."""
    layout = _THREAD_STATES.get(sys.version_info[:2])
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


def _watch_kernels(guard) -> list:
    """While ``guard`` is armed, a Triton kernel of the package that is launched (or, under
    Triton's interpreter, called from a kernel) is a hit: it runs no torch operation that the
    modes could see (under the interpreter its arithmetic is NumPy's). Only where Triton is
    imported already. Returns (class, attribute, original) to put back."""
    watched = []
    jit, interpreter = (sys.modules.get(f"triton.runtime.{name}") for name in ("jit", "interpreter"))
    if jit is not None and hasattr(jit, "JITFunction"):
        watched.append((jit.JITFunction, "run"))
    if interpreter is not None and hasattr(interpreter, "InterpretedFunction"):
        watched += [(interpreter.InterpretedFunction, "run"),
                    (interpreter.InterpretedFunction, "__call__")]
    undo = []
    for cls, name in watched:
        original = cls.__dict__.get(name)
        if original is not None:
            setattr(cls, name, _kernel_watch(guard, original))
            undo.append((cls, name, original))
    return undo


def _kernel_watch(guard, original):
    def watched(kernel, *args, **kwargs):
        code = getattr(getattr(kernel, "fn", None), "__code__", None)
        if guard.armed and code is not None and code.co_filename.startswith(guard.packages):
            guard._hit(_package_name(code.co_filename,
                                     getattr(code, "co_qualname", code.co_name)))
        return original(kernel, *args, **kwargs)
    return watched


def _package_name(filename: str, qualname: str) -> str:
    """``.../course_attn/masks.py`` and ``causal_mask`` -> ``course_attn.masks.causal_mask``."""
    parts = filename.removesuffix(".py").replace(os.sep, "/").split("/")
    start = max((i for i, part in enumerate(parts) if part == "course_attn"),
                default=len(parts) - 1)
    module = ".".join(p for p in parts[start:] if p != "__init__")
    return f"{module}.{qualname}"


def _compile_stance():
    """Graded functions run uncompiled: a cold ``torch.compile`` takes a minute on a small
    machine, and compiled code runs where the guard cannot see it. Only where the submission
    imported the compiler already."""
    if "torch._dynamo" not in sys.modules or not hasattr(torch.compiler, "set_stance"):
        return _Nothing()
    return torch.compiler.set_stance("force_eager")


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- evaluating an exercise in the kernel --------------------------------------------------------

def error_as_data(error: BaseException) -> dict:
    """An exception as data: its type, message and the line of the student's code it came from."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if f.filename.startswith("<ipython-input") or
            f.filename.startswith("/tmp/ipykernel") or "ipykernel_" in f.filename]
    where = (mine or frames)[-1:] if frames else []
    return {"type": type(error).__name__, "message": str(error)[:2000],
            "line": where[0].lineno if where else None}


def evaluate(request: dict, namespace: dict, report=None) -> dict:
    """Run one exercise's cases as the grader asked, on the function or value that
    ``namespace`` (the notebook's globals) holds; returns the answer.

    Request: ``{"name": "causal_mask", "kind": "function" | "value", "cases": [{"args": ...,
    "kwargs": ...}], "ops": [...] | None, "refused": [...], "package": PATH | None,
    "allowed": [[file, qualname], ...]}``. Answer: ``{"found": bool, "results": [{"value": ...}
    | {"error": {...}} | {"unencodable": "..."}, ...], "mutated": [[case, argument], ...],
    "banned": [names], "visited": [native ids of the other threads that have run Python since a
    guard was first armed: each one ran the guard's visit, and took its modes if it ran while
    armed], "python_threads": [native ids of the threads ``threading`` knows]}``.
    ``report(name)`` is called the moment a hit happens.
    """
    name = request["name"]
    answer = {"found": name in namespace, "results": [], "mutated": [], "banned": []}
    target = namespace.get(name)
    guard = Guard.from_options(request, report)
    for number, case in enumerate(request["cases"] if answer["found"] else []):
        if request["kind"] == "value":
            result, args = target, []
        else:
            args, kwargs = decode(case["args"]), decode(case["kwargs"])
            before = json.dumps(encode(args), sort_keys=True)
            try:
                result = guard.call(target, args, kwargs)
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
    answer["banned"] = list(guard.hits)
    answer["visited"] = sorted(_RAN_PYTHON)
    answer["python_threads"] = sorted(t.native_id for t in threading.enumerate() if t.native_id)
    return answer


def _changed_argument(args, before: str) -> int:
    """The index of the first argument whose encoding differs from the one in ``before``."""
    original = json.loads(before)
    for index, arg in enumerate(args):
        if index >= len(original) or encode(arg) != original[index]:
            return index
    return 0


def install(namespace: dict, hits_fd: int, token: str, forbid_new_processes=None) -> None:
    """Set up the grader's side in a kernel, before any cell of the submission has run: keep
    the notebook's namespace, and define a class ``CourseAttnHarness_<token>`` through which
    the grader's expression reaches ``evaluate`` without looking a single name up in that
    namespace (``().__class__.__base__.__subclasses__()`` holds it; a student's variable
    named ``exec`` or ``json`` changes nothing). Hits are written to ``hits_fd``, a pipe only
    the grader reads, the moment they happen: what is written cannot be taken back; so is the
    answer, which the grader reads there rather than in the Jupyter reply.
    ``forbid_new_processes`` (``confine.py``) is what the class's ``confine`` calls before the
    first graded call; the grader checks from outside that it took hold."""
    def report(name):
        try:
            os.write(hits_fd, (json.dumps(name) + "\n").encode())
        except OSError:
            pass

    def run(request_json: str) -> str:
        """Write the answer on the pipe (the grader reads it there, not in the reply)."""
        line = (json.dumps({"answer": json.dumps(evaluate(json.loads(request_json), namespace,
                                                          report))}) + "\n").encode()
        view = memoryview(line)
        while view:
            view = view[os.write(hits_fd, view):]
        return "answered"

    def confine() -> str:
        """'' once the kernel can start no process; else why not."""
        try:
            forbid_new_processes()
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return ""

    # torch starts threads of its own at its first parallel operation (its pool) and its first
    # profile (the profiler's, which a measure exercise uses): started now, they are among the
    # threads the grader counts as the kernel's own, and a thread found later is the notebook's
    torch.ones(1 << 18).exp_()
    with torch.autograd.profiler.profile(profile_memory=True):
        pass
    harness = type(f"CourseAttnHarness_{token}", (), {"evaluate": staticmethod(run),
                                                     "confine": staticmethod(confine)})
    _KEEP.append(harness)
    # Kept alive by the interpreter's exit handlers, which Python code cannot list, rather
    # than by a module table: nothing in sys.modules leads here (without an anchor, the
    # harness would be a cycle of garbage once the install cell's names are deleted).
    import atexit
    atexit.register(_KEEP.clear)


def expression(token: str, request: dict | None) -> str:
    """The grader's user expression that runs ``request`` in a kernel set up by ``install``;
    ``None``: the expression that confines the kernel (no new process from then on)."""
    call = "confine()" if request is None else f"evaluate({json.dumps(request)!r})"
    return ("[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "
            f"'CourseAttnHarness_{token}'][0].{call}")


_KEEP: list = []
# Native ids of the threads that ran Python after a guard asked them to (``Guard._visit``): a
# thread that never does (a loop in TorchScript or C) never takes the guard's modes either.
_RAN_PYTHON: set = set()
_CALL_CODE = Guard.call.__code__
_OWN_FILE = _CALL_CODE.co_filename  # this module's frames are the guard's, never the student's
