"""Hidden cases of chapter 9: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch09 import COUNTS, split_states, tile_case
from course_attn.grading.exercise import Case, hidden

INF = float("-inf")


@hidden("ch09.online_softmax")
def _(gen):
    rows, cols = randint(2, 5, gen), randint(3, 9, gen)
    x = randn(rows, cols, seed=gen, scale=float(randint(1, 5, gen)))
    x = x + torch.arange(cols) * float(randint(1, 3, gen))         # the max moves along the row
    yield Case(f"({rows}, {cols}) scores growing along the rows", (x,))
    x = randn(2, randint(1, 3, gen), cols, seed=gen, scale=300.0)
    x[0, 0, :randint(1, cols - 1, gen)] = INF
    x[1, -1] = INF
    yield Case(f"large scores, a row starting with -inf and a row of -inf, {cols} columns", (x,))
    yield Case("float64", (randn(rows, cols, seed=gen, dtype=torch.float64, scale=4.0),))


@hidden("ch09.merge_states")
def _(gen):
    b, h, tq, d, dv = (randint(1, 2, gen), randint(1, 3, gen), randint(2, 5, gen),
                       randint(2, 6, gen), randint(1, 5, gen))
    tk = randint(3, 10, gen)
    split = torch.randperm(tk, generator=gen) < randint(1, tk - 1, gen)  # both sides hold keys
    yield Case(f"a random split of {tk} keys, B={b}, H={h}, Tq={tq}, D={d}, Dv={dv}",
               split_states(b, h, tq, tk, d, dv, split, gen, scale=float(randint(1, 3, gen))))
    yield Case("rows empty on both sides, and one side empty",
               split_states(1, h, 4, tk, d, dv, randint(1, tk - 1, gen), gen,
                            dead_rows=(randint(0, 3, gen),), empty_side="b"))
    out_a, lse_a, out_b, lse_b = split_states(1, 1, tq, tk, d, dv, randint(1, tk - 1, gen), gen,
                                              dtype=torch.float64)
    shift = float(randint(800, 1200, gen))  # every score shifted: the same outputs, lse + shift
    yield Case(f"float64, log-sum-exps near {shift:.0f}", (out_a, lse_a + shift, out_b,
                                                           lse_b + shift))


@hidden("ch09.tile_update")
def _(gen):
    b, h, tq, bk, dv = (randint(1, 2, gen), randint(1, 3, gen), randint(2, 5, gen),
                        randint(2, 6, gen), randint(1, 5, gen))
    before = randint(1, 3, gen)
    yield tile_case(f"a tile after {before}, the max growing, B={b}, H={h}, Tq={tq}, Bk={bk}",
                    b, h, tq, bk, dv, before, gen, shift=float(randint(3, 8, gen)))
    yield tile_case("the first tile, masked at random", b, h, tq, bk, dv, 0, gen, p_keep=0.6)
    yield tile_case("dead rows after a masked tile", 1, h, 4, bk, dv, before, gen,
                    dead_rows=(randint(0, 3, gen),), p_keep=0.7)
    yield tile_case("float64, the max growing", 1, h, tq, bk, dv, before, gen,
                    dtype=torch.float64, shift=5.0)
    yield tile_case(f"a tile after {before}, every score smaller: the max stays", b, h, tq, bk, dv,
                    before, gen, shift=-float(randint(4, 8, gen)))


@hidden("ch09.tile_mask")
def _(gen):
    # Partial last blocks, Bq != Bk, and Tk - Tq >= Bk, so that counting whole blocks, comparing
    # block numbers or aligning top-left each changes some tile.
    bq = randint(2, 5, gen)
    bk = bq + randint(1, 3, gen)
    tq = bq * randint(1, 4, gen) + randint(1, bq - 1, gen)
    tk = (tq // bk + randint(2, 3, gen)) * bk + randint(1, bk - 1, gen)
    yield Case(f"causal, Tq={tq}, Tk={tk}, blocks {bq} x {bk}", (tq, tk, bq, bk),
               dict(is_causal=True))
    b = randint(2, 4, gen)
    t = b * randint(5, 7, gen) + randint(1, b - 1, gen)
    yield Case(f"causal, {t} x {t} in blocks of {b}", (t, t, b, b), dict(is_causal=True))
    w = randint(2, 7, gen)
    yield Case(f"causal, a window of {w}, Tq={tq}, Tk={tk}, blocks {bq} x {bk}",
               (tq, tk, bq, bk), dict(is_causal=True, window=w))
    w = b * randint(1, 3, gen) + 1  # the nearest query and key of some tile are exactly W apart
    yield Case(f"a window of {w} without causality, {t} x {t}, blocks of {b}", (t, t, b, b),
               dict(is_causal=False, window=w))


@hidden("ch09.flash_counts")
def _(gen):
    # One set of sizes in each regime, on every seed; blocks are powers of two, the rest is
    # drawn inside the regime. Every set has at least two blocks (so counting every tile, or
    # reading K and V once, is wrong) and more query blocks than W // block (so the W // block
    # rule is wrong), except where the regime says otherwise.
    # 1. T and W multiples of the block, the window shorter than the sequence (the chapter's).
    # 2. Neither a multiple: a partial last block, and W mod block >= 2, where W // block + 1
    #    key blocks per query block is one too few.
    # 3. A window shorter than a block (2 <= W < block): still two key blocks per query block.
    # 4. A window at least as long as the sequence: every causal tile, T not a multiple.
    def head():
        return 16 * randint(1, 16, gen)

    block = 2 ** randint(4, 7, gen)
    k = randint(1, 6, gen)
    sizes = [dict(T=block * randint(k + 2, k + 12, gen), block=block, W=block * k, D=head())]
    block = 2 ** randint(3, 7, gen)
    k = randint(1, 5, gen)
    sizes.append(dict(T=block * randint(k + 2, k + 12, gen) + randint(1, block - 1, gen),
                      block=block, W=block * k + randint(2, block - 1, gen), D=head()))
    block = 2 ** randint(3, 7, gen)
    sizes.append(dict(T=block * randint(2, 20, gen) + randint(0, block - 1, gen), block=block,
                      W=randint(2, block - 1, gen), D=head()))
    block = 2 ** randint(3, 7, gen)
    t = block * randint(2, 16, gen) + randint(1, block - 1, gen)
    sizes.append(dict(T=t, block=block, W=t + randint(0, t, gen), D=head()))
    yield from COUNTS.cases(*sizes)
