"""Small synthetic tasks for demos and training: sequences of token ids (B, T).

Every task's ``sample`` returns ``(inputs, targets)``, both (B, T) long, where ``targets[:, t]``
is the token that follows ``inputs[:, t]``, or ``IGNORE_INDEX`` (-100, which
``torch.nn.functional.cross_entropy`` skips) where nothing could predict it.
"""

import string

import torch
from torch import Tensor

from .arguments import check_positive_ints

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "InductionTask", "induction_targets", "token_labels"]


def token_labels(seq) -> list[str]:
    """Token ids as letters for plot axes: 0 -> "A", ..., 25 -> "Z", 26 -> "AA", ...

    ``seq``: one sequence (T,), a tensor or a list of ints.
    """
    ids = torch.as_tensor(seq)
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"token_labels expects one sequence of int ids (T,), got shape "
                         f"{tuple(ids.shape)} dtype {ids.dtype}")
    labels = []
    for i in ids.tolist():
        if i < 0:
            raise ValueError(f"token ids must be >= 0, got {i}")
        label = ""
        i += 1
        while i:
            i, r = divmod(i - 1, 26)
            label = string.ascii_uppercase[r] + label
        labels.append(label)
    return labels


def induction_targets(inputs: Tensor) -> Tensor:
    """Where an induction head should look: (B, T) ids -> (B, T) positions, -1 where none.

    For the token at position t, find its most recent earlier occurrence j < t; the key an
    induction head attends to is j + 1, the token that came *after* it (and is the best guess
    for what comes after t). Positions whose token has not occurred before get -1.
    """
    if not isinstance(inputs, Tensor) or inputs.dim() != 2 or inputs.dtype.is_floating_point \
            or inputs.dtype == torch.bool:
        raise ValueError(f"inputs must be a (B, T) integer tensor, got "
                         f"{tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs)}")
    t = inputs.shape[1]
    same = inputs[:, :, None] == inputs[:, None, :]                      # (B, Tq, Tk)
    earlier = torch.ones(t, t, dtype=torch.bool, device=inputs.device).tril(-1)
    key = torch.arange(t, device=inputs.device)
    previous = torch.where(same & earlier, key, -1).amax(dim=-1)        # (B, T), -1 if none
    return torch.where(previous >= 0, previous + 1, -1)


class InductionTask:
    """Continue a repeating pattern: after "... A B ... A", predict "B".

    Each row is a pattern of L distinct random tokens, repeated until the row is full (T + 1
    tokens, shifted by one into inputs and targets). L is drawn per row from
    [min_pattern_len, max_pattern_len], so counting positions does not help: to predict the
    next token the model must find where the current token occurred before and copy the token
    that followed it, which is what an induction head does. With L = 4, a row reads

        inputs   K Z A B K Z A B K Z ...
        targets  - - - - Z A B K Z A ...      (- is IGNORE_INDEX)

    Targets are ``IGNORE_INDEX`` in the first copy of the pattern (those tokens are random)
    and the true next token everywhere after it: T - L predictable positions per row.
    ``max_pattern_len`` defaults to seq_len // 2, so every row shows its pattern at least twice.
    The defaults (26 tokens, printed as the letters A-Z by ``token_labels``) train in seconds.
    """

    def __init__(self, vocab_size: int = 26, seq_len: int = 32, *, min_pattern_len: int = 4,
                 max_pattern_len: int | None = None):
        max_pattern_len = seq_len // 2 if max_pattern_len is None else max_pattern_len
        check_positive_ints(vocab_size=vocab_size, seq_len=seq_len,
                            min_pattern_len=min_pattern_len, max_pattern_len=max_pattern_len)
        if not 2 <= min_pattern_len <= max_pattern_len < seq_len:
            raise ValueError("need 2 <= min_pattern_len <= max_pattern_len < seq_len, got "
                             f"min_pattern_len={min_pattern_len}, max_pattern_len="
                             f"{max_pattern_len}, seq_len={seq_len}")
        if vocab_size < max_pattern_len:
            raise ValueError(f"vocab_size={vocab_size} is smaller than max_pattern_len="
                             f"{max_pattern_len}: a pattern's tokens must be distinct")
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.min_pattern_len, self.max_pattern_len = min_pattern_len, max_pattern_len

    def __repr__(self) -> str:
        return (f"InductionTask(vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
                f"min_pattern_len={self.min_pattern_len}, max_pattern_len={self.max_pattern_len})")

    def sample(self, batch_size: int, *, generator: torch.Generator | None = None,
               device=None, pattern_len: int | None = None) -> tuple[Tensor, Tensor]:
        """A batch ``(inputs, targets)``, both (B, T) long, T = seq_len.

        Drawn on the CPU from ``generator`` (a CPU ``torch.Generator``; None uses the global
        one), so a seed gives the same batch on every device, then moved to ``device``.
        ``pattern_len``: use this L for every row instead of a random one (e.g. L >= T / 2 for
        rows that show the pattern exactly twice).
        """
        check_positive_ints(batch_size=batch_size)
        b, t = batch_size, self.seq_len
        if pattern_len is None:
            pattern_len = torch.randint(self.min_pattern_len, self.max_pattern_len + 1, (b, 1),
                                        generator=generator)
        elif isinstance(pattern_len, bool) or not isinstance(pattern_len, int) \
                or not 1 <= pattern_len <= min(t - 1, self.vocab_size):
            raise ValueError(f"pattern_len must be an int in [1, min(seq_len - 1, vocab_size) = "
                             f"{min(t - 1, self.vocab_size)}], got {pattern_len!r}")
        # Sorting random keys gives a random permutation per row: its first L are distinct.
        distinct = torch.rand(b, self.vocab_size, generator=generator).argsort(dim=1)
        i = torch.arange(t + 1).unsqueeze(0)                    # (1, T + 1)
        tokens = distinct.gather(1, i % pattern_len)            # (B, T + 1)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        seen_before = i[:, :-1] >= pattern_len                  # (B, T)
        targets = targets.masked_fill(~seen_before, IGNORE_INDEX)
        return inputs.to(device), targets.to(device)

    token_labels = staticmethod(token_labels)
    induction_targets = staticmethod(induction_targets)
