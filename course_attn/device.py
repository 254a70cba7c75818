"""Where tensors live, and how to make a run repeatable."""

import random

import torch


def default_device() -> torch.device:
    """The best device present: CUDA, then Apple's MPS, then the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def available_devices() -> list[torch.device]:
    """Every device present, CPU first; tests run on each of them."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append(torch.device("mps"))
    return devices


def seed_everything(seed: int = 0) -> torch.Generator:
    """Seed Python's and PyTorch's generators; returns a CPU generator seeded the same way."""
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
