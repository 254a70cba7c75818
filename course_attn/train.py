"""Training a tiny GPT on a synthetic task, and measuring what it learned.

``train_induction_model()`` is the course's ready-made experiment: a 2-layer attention-only GPT
that learns ``InductionTask`` on a laptop CPU, and grows an induction head doing so; it records
the heads' scores as training goes, so the moment the head forms can be plotted.
"""

import copy
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from .arguments import check_positive_ints
from .data import IGNORE_INDEX, InductionTask, induction_targets
from .model import GPT, GPTConfig

__all__ = ["INDUCTION_LR", "INDUCTION_STEPS", "TrainedInduction", "accuracy",
           "induction_head_scores", "ov_circuit", "previous_token_scores", "train",
           "train_induction_model"]


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def train(model: GPT, task, *, steps: int, batch_size: int, lr: float, seed: int = 0,
          progress: bool = True, device=None,
          on_step: Callable[[int, GPT], None] | None = None) -> list[float]:
    """Train ``model`` in place with AdamW on fresh batches of ``task``; the loss of every step.

    The loss is next-token cross-entropy over the positions whose target is not IGNORE_INDEX.
    Batches come from a CPU generator seeded with ``seed``, so a run is repeatable: the same
    seed and the same initial weights give the same losses. ``device``: where to train (the
    model is moved there); None keeps the model where it is. ``progress=False`` trains
    silently (no progress bar on stderr). ``on_step(step, model)``, when given, is called after
    each optimizer step with the number of steps done (1 .. steps), e.g. to measure the model
    as it learns; it must not touch the global random state if the run is to stay repeatable.
    Leaves the model in eval mode.
    """
    check_positive_ints(steps=steps, batch_size=batch_size)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if device is not None:
        model.to(device)
    device = _model_device(model)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    bar = tqdm(range(steps), disable=not progress, desc="training", mininterval=0.5)
    for _ in bar:
        inputs, targets = task.sample(batch_size, generator=generator, device=device)
        logits = model(inputs)                                              # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if on_step is not None:
            on_step(len(losses), model)
    model.eval()
    return losses


@torch.no_grad()
def accuracy(model: GPT, task, *, batch_size: int = 256,
             generator: torch.Generator | None = None) -> float:
    """Fraction of predictable positions (target != IGNORE_INDEX) where the argmax is right."""
    inputs, targets = task.sample(batch_size, generator=generator, device=_model_device(model))
    predicted = model(inputs).argmax(dim=-1)                                 # (B, T)
    scored = targets != IGNORE_INDEX
    return (predicted[scored] == targets[scored]).float().mean().item()


@torch.no_grad()
def induction_head_scores(model: GPT, task, *, batch_size: int = 64,
                          generator: torch.Generator | None = None) -> Tensor:
    """(n_layers, n_heads): each head's mean attention weight on the induction target.

    For every position t whose token occurred exactly once before, at j, take the weight head h
    puts on key j + 1 (``induction_targets``), the token that followed it; average over all such
    positions in a batch of ``task``. An induction head scores near 1; a head that spreads its
    attention evenly scores 1 / (t + 1) at position t, one over the number of keys it can see.
    (Positions whose token occurred several times before are left out: there an induction head
    may split its attention between the earlier occurrences, which all predict the same token.)
    """
    inputs, _ = task.sample(batch_size, generator=generator, device=_model_device(model))
    _, attention = model(inputs, return_attention=True)
    return _induction_scores(inputs, torch.stack(attention, dim=1))


def _induction_scores(inputs: Tensor, weights: Tensor) -> Tensor:
    """inputs (B, T), weights (B, n_layers, H, T, T) -> (n_layers, H) induction scores."""
    target = induction_targets(inputs)                       # (B, T), -1 where none
    first_time = target < 0
    # Seen exactly once before: the earlier occurrence (at target - 1) was itself a first time.
    once = ~first_time & first_time.gather(1, (target - 1).clamp(min=0))
    index = target.clamp(min=0)[:, None, None, :, None].expand(*weights.shape[:-1], 1)
    on_target = weights.gather(-1, index).squeeze(-1)        # (B, n_layers, H, T)
    on_target = on_target * once[:, None, None, :]
    return on_target.sum(dim=(0, 3)) / once.sum().clamp(min=1)


@torch.no_grad()
def previous_token_scores(model: GPT, task, *, batch_size: int = 64,
                          generator: torch.Generator | None = None) -> Tensor:
    """(n_layers, n_heads): each head's mean attention weight on the previous position.

    For every query position t = 1 .. T-1 of a batch of ``task``, the weight the head puts on
    key t - 1, averaged. A previous-token head scores near 1; a head that spreads its weight
    evenly scores 1 / (t + 1) at position t.
    """
    inputs, _ = task.sample(batch_size, generator=generator, device=_model_device(model))
    _, attention = model(inputs, return_attention=True)
    return _previous_token_scores(torch.stack(attention, dim=1))


def _previous_token_scores(weights: Tensor) -> Tensor:
    """weights (B, n_layers, H, T, T) -> (n_layers, H) previous-token scores."""
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 3))


@torch.no_grad()
def ov_circuit(model: GPT, layer: int, head: int) -> Tensor:
    """(V, V): the logits that ``head`` of ``layer`` adds when it reads a position holding one
    token; row a is for token a, column b is the logit of token b.

    The head's "OV circuit" (output-value): token a's embedding, normalised by the layer's
    attention norm, goes through the head's value projection W_V and its block of the output
    projection W_O; the model's final norm and LM head turn the result into logits. The norms
    see these vectors alone, as if the position held token a and nothing else and the head's
    output were all that reached the last layer. A head that *copies* the token it attends to
    has, in every row a, its largest logit on column a.
    """
    if not 0 <= layer < len(model.blocks):
        raise ValueError(f"layer must be in [0, {len(model.blocks)}), got {layer!r}")
    block = model.blocks[layer]
    attn = block.attn
    if not 0 <= head < attn.n_heads:
        raise ValueError(f"head must be in [0, {attn.n_heads}), got {head!r}")
    d = attn.head_dim
    kv_head = head // (attn.n_heads // attn.n_kv_heads)     # the value head this query head reads
    x = block.attn_norm(model.token_embedding.weight)                        # (V, C)
    value = attn.v_proj(x)[:, kv_head * d:(kv_head + 1) * d]                 # (V, D)
    written = value @ attn.out_proj.weight[:, head * d:(head + 1) * d].T     # (V, C)
    return model.lm_head(model.final_norm(written))                          # (V, V)


@contextmanager
def _one_thread():
    # A model this small runs fastest on one CPU thread; more threads mostly wait on each other,
    # and a fixed thread count keeps the floating-point sums, hence the run, identical.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class TrainedInduction:
    """What ``train_induction_model`` returns: the model, its task, the loss of every step, the
    accuracy on a held-out batch (predictable positions only), a copy of the model as it was
    initialised (before the first step), and every head's scores measured during training:
    ``induction_history`` and ``previous_token_history``, both (len(steps), n_layers, n_heads),
    row i measured after ``steps[i]`` training steps (``steps[0] == 0``: before training)."""

    model: GPT
    task: InductionTask
    losses: list[float]
    accuracy: float
    initial_model: GPT
    steps: list[int]
    induction_history: Tensor
    previous_token_history: Tensor


# Chapter 1's experiment: the learning rate and steps the tiny induction model trains with
# (chapter 6 compares its own rate with this one).
INDUCTION_LR = 3e-3
INDUCTION_STEPS = 300


def train_induction_model(*, seed: int = 0, progress: bool = True,
                          record_every: int = 5) -> TrainedInduction:
    """Train a 2-layer attention-only GPT on ``InductionTask`` until it solves it.

    Runs on the CPU, on one thread. ``seed`` fixes the initial weights and the training batches
    (the global random state is left untouched); the accuracy is measured on a held-out batch
    drawn with seed + 10_000. Before training and after every ``record_every`` steps, every
    head's ``induction_head_scores`` and ``previous_token_scores`` are measured on one fixed
    batch (drawn with seed + 20_000); measuring changes nothing in the training run.
    ``progress=False`` trains silently.
    """
    check_positive_ints(record_every=record_every)
    task = InductionTask()
    config = GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, d_model=64, n_heads=2,
                       n_layers=2, mlp=False, backend="sdpa")
    steps, induction, previous = [], [], []
    # The batch both scores are measured on: the one induction_head_scores(model, task,
    # generator=torch.Generator().manual_seed(seed + 20_000)) would draw.
    probe, _ = task.sample(64, generator=torch.Generator().manual_seed(seed + 20_000))

    @torch.no_grad()
    def record(step: int, model: GPT) -> None:
        if step % record_every == 0:
            _, attention = model(probe, return_attention=True)
            weights = torch.stack(attention, dim=1)          # (B, n_layers, H, T, T)
            steps.append(step)
            induction.append(_induction_scores(probe, weights))
            previous.append(_previous_token_scores(weights))

    with _one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
        initial_model = copy.deepcopy(model).eval()
        record(0, model)
        losses = train(model, task, steps=INDUCTION_STEPS, batch_size=32, lr=INDUCTION_LR,
                       seed=seed, progress=progress, device="cpu", on_step=record)
        held_out = torch.Generator().manual_seed(seed + 10_000)
        return TrainedInduction(model, task, losses, accuracy(model, task, generator=held_out),
                                initial_model, steps, torch.stack(induction),
                                torch.stack(previous))
