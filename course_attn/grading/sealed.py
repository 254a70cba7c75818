"""The kernel side of grading: checks whose outcome the grader can verify.

The grader (``grader.py``) starts a fresh kernel for a submission and, before the submission's
first cell, runs a preamble that calls ``install(key_file, name, check_modules)``. ``install``

- reads a secret key that the grader made for this run from ``key_file``, and deletes the file;
- imports every chapter's checks (and ``check_modules``) and keeps its own references to each
  exercise's case generator;
- takes a ``Snapshot`` of the code the checks depend on: every ``course_attn`` module, the check
  modules, ``torch``, ``torch.Tensor``, ``torch.testing``, ``math``, the builtins, and the
  profiler switches of ``sys``;
- puts into the user namespace, as ``name`` (random per run), an object with ``begin`` and
  ``end``.

The grader then runs each check cell, restored from ``solutions/`` with its hidden tests, as::

    check = <name>.begin("<nonce>")
    check("ch03.causal_mask", causal_mask)
    ### BEGIN HIDDEN TESTS
    ...
    ### END HIDDEN TESTS
    <name>.end("<nonce>")

``check`` runs the cases with calls to the reference forbidden, prints the usual report, and
publishes a *report* message; ``end`` publishes a *done* message only if every check of the cell
ran to a pass, none is still running, and the snapshot is intact. Both are display data of type
``MIME_TYPE``, signed with HMAC-SHA256 under the key. The decisive fields (kind, nonce, exercise
names, pass or fail) are signed; the case results that come with a report are for the reasons
only. The grader counts an exercise when the check cell's execute reply is "ok" *and* a valid
done message carries the nonce it put in that cell; see ``grader.py`` for the threat model.
"""

import _hashlib
import importlib
import math
import os
import sys
import types

MIME_TYPE = "application/vnd.course-attn.grading+json"
FIELD_SEPARATOR = "\x1f"
# IPython and ipykernel set these in builtins again around every cell.
_IPYTHON_BUILTINS = {"get_ipython", "display", "exit", "quit", "__IPYTHON__", "_", "__", "___",
                     "input", "raw_input"}
_PROFILER_SWITCHES = ("setprofile", "getprofile", "settrace", "gettrace")
_hmac_digest = _hashlib.hmac_digest  # C code: nothing a submission patches runs inside it


def signed_text(payload: dict) -> str:
    """The text that ``payload``'s ``mac`` signs: its decisive fields, in a fixed order."""
    exercises = payload.get("exercises", [])
    names = FIELD_SEPARATOR.join(str(name) for name in exercises) if isinstance(exercises, list) \
        else ""
    return FIELD_SEPARATOR.join((str(payload.get("kind")), str(payload.get("nonce")), names,
                                 str(payload.get("passed") is True)))


def mac(key: bytes, payload: dict) -> str:
    """HMAC-SHA256 of ``signed_text(payload)`` under ``key``, in hex."""
    return _hmac_digest(key, signed_text(payload).encode("utf-8"), "sha256").hex()


def is_authentic(key: bytes, payload) -> bool:
    """Whether ``payload`` (as it reached the grader) carries a valid signature."""
    if not isinstance(payload, dict) or not isinstance(payload.get("mac"), str):
        return False
    return _compare_digest(payload["mac"], mac(key, payload))


def _compare_digest(a: str, b: str) -> bool:
    return len(a) == len(b) and _hashlib.compare_digest(a.encode(), b.encode())


class Snapshot:
    """What a set of namespaces held when it was taken; ``changes()`` names each entry replaced
    or deleted since (for a function, also its code or defaults swapped in place) and, in a
    class, each attribute added (it could shadow one of a base class)."""

    def __init__(self, namespaces: list[tuple[str, object, bool]]):
        """``namespaces``: (label, module or class or dict, everything?); without
        ``everything`` only callables, classes and modules are kept (data such as
        ``sys.stdout`` may change)."""
        self._entries = []  # (label, live dict, {key: parts}, keys of a class, or None)
        for label, namespace, everything in namespaces:
            live = namespace if isinstance(namespace, dict) else vars(namespace)
            kept = {key: _parts(value) for key, value in list(live.items())
                    if everything or callable(value) or isinstance(value, types.ModuleType)}
            class_keys = set(live) if isinstance(namespace, type) else None
            self._entries.append((label, live, kept, class_keys))

    def changes(self) -> list[str]:
        changed = []
        for label, live, kept, class_keys in self._entries:
            for key, parts in kept.items():
                if key not in live or not _same_parts(_parts(live[key]), parts):
                    changed.append(f"{label}.{key}")
            if class_keys is not None and len(live) != len(class_keys):
                changed.extend(f"{label}.{key}" for key in live if key not in class_keys)
        return changed


def _parts(value) -> tuple:
    """``value`` and, for a function, the parts of it that can be swapped in place."""
    return (value, getattr(value, "__code__", None), getattr(value, "__defaults__", None),
            getattr(value, "__kwdefaults__", None))


def _same_parts(a: tuple, b: tuple) -> bool:
    return all(x is y for x, y in zip(a, b))


def _guarded_namespaces(check_modules: set[str]) -> list[tuple[str, object, bool]]:
    import builtins

    import torch
    import torch.testing
    import torch.testing._comparison

    own = sorted(name for name in sys.modules
                 if name == "course_attn" or name.startswith("course_attn.")
                 or name in check_modules)
    namespaces = []
    for module_name in own:
        module = sys.modules[module_name]
        namespaces.append((module_name, module, True))
        for key, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module_name:
                namespaces.append((f"{module_name}.{key}", value, True))
    return namespaces + [
        ("torch", torch, False), ("torch.Tensor", torch.Tensor, False),
        ("torch.testing", torch.testing, False),
        ("torch.testing._comparison", torch.testing._comparison, False), ("math", math, False),
        ("builtins", _Only(vars(builtins), set(vars(builtins)) - _IPYTHON_BUILTINS), False),
        ("sys", _Only(vars(sys), set(_PROFILER_SWITCHES)), False),
    ]


class _Only(dict):
    """The live dict ``live`` as seen through ``keys``: what a Snapshot of it keeps."""

    def __init__(self, live: dict, keys: set[str]):
        super().__init__()
        self._live, self._keys = live, keys

    def items(self):
        return [(k, v) for k, v in self._live.items() if k in self._keys]

    def __contains__(self, key):
        return key in self._live

    def __getitem__(self, key):
        return self._live[key]


def install(key_file: str, name: str, check_modules=()) -> None:
    """Set up sealed checks in this kernel (see the module's docstring). Called by the grader's
    preamble, before any cell of the submission has run."""
    from IPython import get_ipython

    from . import registry

    with open(key_file, "rb") as file:
        key = file.read()
    os.remove(key_file)
    shell = get_ipython()
    publish = shell.display_pub.publish
    for module in check_modules:
        importlib.import_module(module)
    registry.exercises()  # imports every chapter's checks
    case_generators = dict(registry._EXERCISES)
    namespaces = _guarded_namespaces(set(check_modules))
    registered = [(f"{module.__name__}.{gen.__qualname__} for {exercise}", gen)
                  for exercise, gen in case_generators.items()
                  if (module := sys.modules.get(gen.__module__)) is not None]
    snapshot = Snapshot(namespaces + [(label, {"generator": gen}, True)
                                      for label, gen in registered])
    exercises_now = registry._EXERCISES
    run_cases, format_report = registry.run_cases, registry.format_report
    Report, CaseResult, ExerciseFailed = registry.Report, registry.CaseResult, \
        registry.ExerciseFailed
    state = {"nonce": None, "checked": [], "running": False}

    def tampering() -> list[str]:
        changed = snapshot.changes()
        for exercise, generator in case_generators.items():
            if exercises_now.get(exercise) is not generator:
                changed.append(f"the registered checks of {exercise}")
        return sorted(changed)

    def emit(payload: dict) -> None:
        payload["mac"] = mac(key, payload)
        publish(data={MIME_TYPE: payload}, metadata={})

    def begin(nonce: str):
        if state["running"]:
            raise ExerciseFailed("the grading check was restarted from inside a check")
        state.update(nonce=nonce, checked=[], running=False)

        def check(exercise: str, fn) -> None:
            if state["running"] or state["nonce"] != nonce:
                raise ExerciseFailed("the grading check was called from inside a check")
            tampered = tampering()
            state["running"] = True
            try:
                if tampered:
                    report = Report(exercise)
                else:
                    generator = case_generators.get(exercise) or registry._load(exercise)
                    report = run_cases(exercise, generator, fn, forbid_reference=True)
                    tampered = tampering()
            finally:
                state["running"] = False
            if tampered:
                report.results.append(CaseResult(
                    "the grading code is intact", False,
                    "the submission changed " + ", ".join(tampered[:5])
                    + (f" and {len(tampered) - 5} more" if len(tampered) > 5 else "")))
            passed = bool(report.results) and all(r.passed for r in report.results)
            state["checked"].append((exercise, passed))
            emit({"kind": "report", "nonce": nonce, "exercises": [exercise], "passed": passed,
                  "tampered": tampered,
                  "results": [{"name": str(r.name), "passed": bool(r.passed),
                               "message": str(r.message),
                               "reference_called": str(r.reference_called)}
                              for r in report.results]})
            print(format_report(report))
            if not passed:
                failed = sum(not r.passed for r in report.results)
                raise ExerciseFailed(f"{exercise}: {failed} of {len(report.results)} checks "
                                     "failed (see above)")
        return check

    def end(nonce: str) -> None:
        current, checked, running = state["nonce"], state["checked"], state["running"]
        if running:
            raise ExerciseFailed("the grading check was ended from inside a check")
        state.update(nonce=None, checked=[])
        if current != nonce or not checked or not all(ok for _, ok in checked):
            raise ExerciseFailed("the check cell did not run its checks to a pass")
        tampered = tampering()
        if tampered:
            raise ExerciseFailed("the submission changed " + ", ".join(tampered[:5]))
        emit({"kind": "done", "nonce": nonce, "exercises": [name for name, _ in checked],
              "passed": True})

    shell.user_ns[name] = types.SimpleNamespace(begin=begin, end=end)
