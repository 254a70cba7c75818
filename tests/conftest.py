"""Shared test setup: every device present, hypothesis profiles, the shared helpers on the path
(helpers.py here, check_support.py and grading_support.py in fixtures/), and every exercise's
hidden cases loaded, as the grader has them.

Profiles (pick one with ``HYPOTHESIS_PROFILE=name``):
  ci        the default: 25 examples per property, derandomized so a run is repeatable
  thorough  300 random examples per property, for hunting bugs by hand
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from course_attn import available_devices
# Before any test module imports torch._dynamo (which imports Triton): chapter 9's Triton
# exercise runs under Triton's interpreter where there is no CUDA, and the interpreter works only
# if it imported Triton first (course_attn.grading.ch09.import_triton_for_its_interpreter).
from course_attn.grading import ch09  # noqa: E402, F401
from course_attn.grading.exercise import load_hidden  # noqa: E402

TESTS = Path(__file__).resolve().parent
# Test modules import their shared helpers by module name, in any pytest import mode.
sys.path[:0] = [str(TESTS), str(TESTS / "fixtures")]
load_hidden(TESTS.parent / "solutions")

settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEVICES = available_devices()


@pytest.fixture(scope="session", params=DEVICES, ids=str)
def device(request) -> torch.device:
    """Each device present: the CPU always, CUDA and MPS where available."""
    return request.param


@pytest.fixture(scope="session")
def other_device(device) -> torch.device:
    """A device other than ``device``; the test is skipped when there is only one."""
    others = [d for d in DEVICES if d != device]
    if not others:
        pytest.skip(f"needs a second device; only {device} is present")
    return others[0]


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` work on ``device`` (MPS has no float64)."""
    return not (device.type == "mps" and dtype == torch.float64)


@pytest.fixture(scope="session")
def require_dtype():
    """``require_dtype(device, dtype)`` skips the test where the device lacks the dtype."""
    def require(device: torch.device, dtype: torch.dtype) -> None:
        if not supports(device, dtype):
            pytest.skip(f"{dtype} is not supported on {device}")
    return require


@pytest.fixture(autouse=True)
def no_torch_mode_left_behind():
    """Each test leaves torch's mode stacks as it found them: a mode left on a stack (a
    guard not taken off) sends every later torch call of the process through Python, and made
    the modules after it run several times slower."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    stacks = (torch.overrides._get_current_function_mode_stack, _get_current_dispatch_mode_stack)
    before = [list(stack()) for stack in stacks]
    yield
    after = [list(stack()) for stack in stacks]
    assert after == before, f"torch modes left on the stacks: {after} (before: {before})"
