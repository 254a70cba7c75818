"""The book tests the package (issue 32): a plausible bug put into ``course_attn`` must make the
chapter that teaches that idea fail.

Each bug is an exact textual replacement in one module of a copy of the package (the shared
tree is never touched). The old text must occur exactly once, so that a refactor of the package
fails here loudly instead of testing nothing. The chapter then runs with nbclient, as the book
is built (in book/, the book's per-cell timeout), in a kernel whose PYTHONPATH puts the copy
first; an injected first cell asserts that the kernel imported the copy (not the editable install
of the shared tree) and imports the mutated module. The chapter must stop at an assert: an
AssertionError in one of its own cells, never an error of the injected cell or an import error.
Which cell caught the bug is printed (``-s``); cell numbers are indices into the stored chapter.

A bug whose section sits at the end of a long chapter may name the cells that run (``cells``,
by their notebook ids: the chapter's set-up cells and the section that teaches the idea, run in
the chapter's order), so that the slow sections before it are not run again for every such bug;
each of these cells is the chapter's own, unchanged.

A control runs each chapter, unmutated, through the same harness up to the last cell at which a
bug of that chapter was caught, and each set of ``cells`` in full: those cells pass with the copy
as it is, so a failure under a bug is the bug's doing.
"""

import os
import shutil
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import yaml
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
# The book's own per-cell limit (_config.yml), so that a cell slow on a busy machine is not a bug.
CELL_TIMEOUT = yaml.safe_load((ROOT / "_config.yml").read_text())["execute"]["timeout"]


@dataclass(frozen=True)
class Bug:
    """``old`` -> ``new`` in ``course_attn/<module>``; ``chapter`` is the notebook that teaches
    the idea (book/<chapter>.ipynb) and must fail; ``cells``: the ids of the only cells of it
    to run, or None for the whole chapter."""

    id: str
    chapter: str
    module: str
    old: str
    new: str
    cells: tuple[str, ...] | None = None


# Cells (by id) of a chapter that a bug of its last section needs, for ``Bug.cells``: the
# chapter's imports, then that section.
CHECKPOINT_CELLS = ("e2e23661",        # chapter 8's imports
                    "edbc284f",        # the tiny Llama: imports transformers, the folder, ids
                    "kv-three-archs")  # GPT-2, Qwen3 and Mistral against transformers
DELTA_CELLS = ("253a2789",             # chapter 10's imports
               "9b08cc8b")             # the delta rule: recurrent, chunked, step by step
ROUNDS_CELLS = ("perf-01",             # the appendix's imports and the machine
                "perf-median")         # the rounds behind one measurement
REAL_MODELS_CELLS = ("real-01",       # the real-models appendix's imports and prompts
                     "real-03",       # save_and_load
                     "real-qwen2", "real-phi3", "real-olmo2", "real-gemma3")

BUGS = [
    Bug("ch02-scale-1-over-D", "02_scaled_dot_product", "attention.py",
        "scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale",
        "scale = 1.0 / q.shape[-1] if scale is None else scale"),
    Bug("ch02-softmax-no-max-shift", "02_scaled_dot_product", "attention.py",
        "e = torch.exp(x - m)",
        "e = torch.exp(x)"),
    Bug("ch02-dropout-also-in-eval", "02_scaled_dot_product", "multihead.py",
        "dropping = self.training and self.dropout > 0",
        "dropping = self.dropout > 0"),
    Bug("ch03-causal-mask-hides-diagonal", "03_masking", "masks.py",
        "return query_key_offsets(tq, tk, align=align, device=device) >= 0",
        "return query_key_offsets(tq, tk, align=align, device=device) > 0"),
    Bug("ch03-padding-keeps-one-pad", "03_masking", "masks.py",
        "keep = torch.arange(t, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)",
        "keep = torch.arange(t, device=lengths.device).unsqueeze(0) <= lengths.unsqueeze(1)"),
    Bug("ch04-merge-heads-without-transpose", "04_multi_head", "multihead.py",
        "return x.transpose(1, 2).reshape(b, t, h * d)",
        "return x.reshape(b, t, h * d)"),
    Bug("ch05-rope-exponent-off-by-one", "05_rope", "rope.py",
        "(float(base) ** (-2.0 * i / head_dim))",
        "(float(base) ** (-2.0 * (i + 1) / head_dim))"),
    Bug("ch05-rope-rotates-backwards", "05_rope", "rope.py",
        "out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)",
        "out = torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)"),
    Bug("ch06-rmsnorm-sum-not-mean", "06_qk_norm", "norm.py",
        "x32.pow(2).mean(dim=-1, keepdim=True)",
        "x32.pow(2).sum(dim=-1, keepdim=True)"),
    Bug("ch07-gqa-tiles-instead-of-groups", "07_mqa_gqa", "attention.py",
        "return x[:, :, None].expand(b, h_kv, n_rep, t, d).reshape(b, h_kv * n_rep, t, d)",
        "return x[:, None].expand(b, n_rep, h_kv, t, d).reshape(b, h_kv * n_rep, t, d)"),
    Bug("ch07-flash-groups-query-heads-tiled", "07_mqa_gqa", "flash.py",
        "self.q = q.unflatten(1, (hkv, self.g))",
        "self.q = q.unflatten(1, (self.g, hkv)).transpose(1, 2)"),
    Bug("ch08-decode-positions-restart-at-0", "08_kv_cache", "multihead.py",
        "positions = torch.arange(len(cache), len(cache) + x.shape[1], device=x.device)",
        "positions = torch.arange(x.shape[1], device=x.device)"),
    Bug("ch08-causal-aligned-top-left", "08_kv_cache", "masks.py",
        'shift = tk - tq if align == "bottom_right" else 0',
        "shift = 0"),
    Bug("ch09-flash-forgets-to-rescale-acc", "09_flash_attention", "flash.py",
        "acc = torch.baddbmm(acc * alpha, p, tiles.v[:, ks:ke])",
        "acc = torch.baddbmm(acc, p, tiles.v[:, ks:ke])"),
    Bug("ch09-online-softmax-forgets-to-rescale-sum", "09_flash_attention", "flash.py",
        "l = l * torch.exp(m - m_new) + torch.exp(xb - m_new).sum(dim=-1, keepdim=True)",
        "l = l + torch.exp(xb - m_new).sum(dim=-1, keepdim=True)"),
    Bug("ch09-merge-takes-max-not-logaddexp", "09_flash_attention", "flash.py",
        "lse = torch.logaddexp(lse_a, lse_b)",
        "lse = torch.maximum(lse_a, lse_b)"),
    Bug("ch09-causal-reach-misses-diagonal", "09_flash_attention", "masks.py",
        "hi = last + 1 if is_causal else",
        "hi = last if is_causal else"),
    Bug("ch10-chunked-prefix-inclusive", "10_linear_attention", "linear.py",
        "s_before, z_before = s.cumsum(2) - s, z.cumsum(2) - z",
        "s_before, z_before = s.cumsum(2), z.cumsum(2)"),
    Bug("ch10-elu-features-without-plus-one", "10_linear_attention", "linear.py",
        "return F.elu(x) + 1",
        "return F.elu(x)"),
    Bug("ch10-step-reads-before-adding-its-token", "10_linear_attention", "linear.py",
        "    state = state.add(fk, v)\n"
        "    return state.read(fq, eps).unsqueeze(2).to(q_t.dtype), state",
        "    return state.read(fq, eps).unsqueeze(2).to(q_t.dtype), state.add(fk, v)"),
    Bug("ch11-block-reach-drops-oldest-key", "11_local_attention", "masks.py",
        "lo = 0 if window is None else first - window + 1",
        "lo = 0 if window is None else first - window + 2"),
    Bug("ch11-window-edge-inclusive", "11_local_attention", "masks.py",
        "allowed &= d < window if is_causal else d.abs() < window",
        "allowed &= d <= window if is_causal else d.abs() <= window"),
    # the modules added since: roofline and checkpoints (chapter 8), the delta rule (10), the
    # paged pool and the engine (12), timing (the appendix)
    Bug("ch08-roofline-kv-read-per-query-head", "08_kv_cache", "roofline.py",
        "k_and_v = 2 * batch * kv_heads * kv_len * head_dim",
        "k_and_v = 2 * batch * heads * kv_len * head_dim"),
    Bug("ch08-gpt2-wv-left-in-conv1d-layout", "08_kv_cache", "checkpoints.py",
        'out[f"{ours}attn.{name}.weight"] = qkv_w[j * c:(j + 1) * c]',
        'out[f"{ours}attn.{name}.weight"] = '
        'qkv_w[j * c:(j + 1) * c] if j < 2 else qkv_w[j * c:(j + 1) * c].t()',
        cells=CHECKPOINT_CELLS),
    Bug("ch08-qwen3-qk-norm-after-rope", "08_kv_cache", "checkpoints.py",
        "qk_norm=config.qk_norm,",
        'qk_norm=config.qk_norm, qk_norm_order="after_rope",',
        cells=CHECKPOINT_CELLS),
    Bug("ch08-mistral-window-one-key-too-wide", "08_kv_cache", "checkpoints.py",
        'window = raw.get("sliding_window")',
        'window = raw.get("sliding_window") + 1',
        cells=CHECKPOINT_CELLS),
    Bug("ch08-llama3-rope-scaling-dropped", "08_kv_cache", "checkpoints.py",
        "                    scaling=scaling)",
        "                    scaling=None)",
        cells=CHECKPOINT_CELLS),
    Bug("ch09-roofline-causal-pairs-miss-diagonal", "09_flash_attention", "roofline.py",
        "kv_len - q_len + i + 1",
        "kv_len - q_len + i"),
    Bug("ch10-delta-rule-adds-without-erasing", "10_linear_attention", "linear.py",
        "beta.unsqueeze(-1) * (v - stored)",
        "beta.unsqueeze(-1) * v",
        cells=DELTA_CELLS),
    Bug("ch10-gated-delta-chunk-reads-undecayed-state", "10_linear_attention", "linear.py",
        "outs.append(gamma[:, :, i, :, None] * (q[:, :, i] @ state) + inside[:, :, i] @ written)",
        "outs.append((q[:, :, i] @ state) + inside[:, :, i] @ written)",
        cells=DELTA_CELLS),
    Bug("ch12-gather-in-pool-order", "12_serving", "paged.py",
        "blocks = pool[block_tables.clamp(min=0)]",
        "blocks = pool[block_tables.clamp(min=0).sort(dim=1).values]"),
    Bug("ch12-block-freed-while-shared", "12_serving", "paged.py",
        "        self.refcount[block] -= 1\n"
        "        if self.refcount[block] == 0:\n"
        "            self._free.append(block)",
        "        self.refcount[block] -= 1\n"
        "        self._free.append(block)"),
    Bug("ch12-position-one-too-far", "12_serving", "serve.py",
        "positions = torch.cat([torch.arange(len(r.table) - r.new, len(r.table))",
        "positions = torch.cat([torch.arange(len(r.table) - r.new + 1, len(r.table) + 1)"),
    # (a preempted request resumed without its tokens cannot be written since the engine feeds
    # what a table lacks, in chunks: a request fed too little is fed the rest in the next step)
    Bug("ch12-shared-block-written-in-the-same-step", "12_serving", "serve.py",
        "            if common > written_before:             # keys computed in this step's "
        "forward\n"
        "                common = max(written_before, common // bs * bs)",
        "            pass"),
    # the real-models appendix: each architecture's detail that loads without a complaint when
    # it is wrong (a Qwen2 read without its biases is refused by the loader, by name)
    Bug("real-qwen2-query-bias-not-permuted-with-its-rows", "appendix_real_models",
        "checkpoints.py",
        'if name.endswith(("attn.q_proj.weight", "attn.q_proj.bias", "q_proj.norm.weight")):',
        'if name.endswith(("attn.q_proj.weight", "q_proj.norm.weight")):',
        cells=REAL_MODELS_CELLS),
    Bug("real-phi3-fused-k-and-v-cut-in-the-wrong-order", "appendix_real_models",
        "checkpoints.py",
        '        out[ours + "attn.k_proj.weight"] = qkv[q:q + kv]\n'
        '        out[ours + "attn.v_proj.weight"] = qkv[q + kv:]',
        '        out[ours + "attn.k_proj.weight"] = qkv[q + kv:]\n'
        '        out[ours + "attn.v_proj.weight"] = qkv[q:q + kv]',
        cells=REAL_MODELS_CELLS),
    Bug("real-olmo2-mlp-norm-before-not-after", "appendix_real_models", "checkpoints.py",
        "return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x) if before else x)), weights",
        "return x + self.mlp(self.pre_mlp_norm(x) if before else self.post_mlp_norm(x)), weights",
        cells=REAL_MODELS_CELLS),
    Bug("real-gemma3-embeddings-not-scaled", "appendix_real_models", "checkpoints.py",
        "embedding_scale=config.d_model ** 0.5,",
        "embedding_scale=1.0,",
        cells=REAL_MODELS_CELLS),
    Bug("real-gemma3-global-layer-one-too-early", "appendix_real_models", "checkpoints.py",
        'sliding_layers=tuple(kind == "sliding_attention" for kind in kinds),',
        'sliding_layers=tuple(kind == "sliding_attention" for kind in kinds[1:] + kinds[:1]),',
        cells=REAL_MODELS_CELLS),
    Bug("appendix-time-is-the-fastest-round", "appendix_performance", "timing.py",
        "Measured(statistics.median(times[name]),",
        "Measured(min(times[name]),",
        cells=ROUNDS_CELLS),
    Bug("appendix-unsettled-ratios-printed", "appendix_performance", "timing.py",
        "return width is not None and width <= tolerance",
        "return width is None or width > tolerance",
        cells=ROUNDS_CELLS),
]


def mutated_copy(bug: Bug | None, folder: Path) -> Path:
    """A copy of the package under ``folder``, with ``bug`` applied; returns the folder to put
    first on PYTHONPATH."""
    shutil.copytree(ROOT / "course_attn", folder / "course_attn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if bug is not None:
        path = folder / "course_attn" / bug.module
        source = path.read_text()
        count = source.count(bug.old)
        assert count == 1, (f"{bug.id}: course_attn/{bug.module} holds the text to mutate "
                            f"{count} times, not once (was the package refactored? update the "
                            f"bug): {bug.old!r}")
        mutated = source.replace(bug.old, bug.new)
        compile(mutated, str(path), "exec")                # a SyntaxError here is the bug's own
        path.write_text(mutated)
    return folder


def guard_cell(package_root: Path, module: str) -> nbformat.NotebookNode:
    """The injected first cell: the kernel imported the copy, and the mutated module imports."""
    expected = str((package_root / "course_attn").resolve())
    return nbformat.v4.new_code_cell(textwrap.dedent(f"""\
        import importlib, pathlib
        import torch
        import course_attn
        _where = str(pathlib.Path(course_attn.__file__).resolve().parent)
        assert _where == {expected!r}, f"the kernel imported course_attn from {{_where}}"
        importlib.import_module("course_attn.{module.removesuffix('.py')}")
        """))


@dataclass
class Run:
    """Where a chapter stopped: the index (in the chapter as stored) of the cell that raised,
    or None when it ran to the end, with the error's name and message; and the seconds it took."""

    cell: int | None
    ename: str
    evalue: str
    seconds: float


def run_chapter(chapter: str, package_root: Path, module: str, *, stop_after: int | None = None,
                cells: tuple[str, ...] | None = None, on_path: bool = True) -> Run:
    """Executes book/<chapter>.ipynb (its first ``stop_after + 1`` cells, when given, or only
    the cells whose ids are ``cells``) as the book is built, after the guard cell, in a kernel
    that imports course_attn from ``package_root`` (put first on PYTHONPATH unless ``on_path``
    is False: the guard's own test). The cell that stopped it is numbered as in the stored
    chapter."""
    nb = nbformat.read(BOOK / f"{chapter}.ipynb", as_version=4)
    stored = list(range(len(nb.cells)))
    if cells is not None:
        index = {cell.get("id"): i for i, cell in enumerate(nb.cells)}
        missing = [c for c in cells if c not in index]
        assert not missing, f"book/{chapter} has no cell with the id {missing}: update the bug"
        stored = sorted(index[c] for c in cells)
    if stop_after is not None:
        stored = [i for i in stored if i <= stop_after]
    nb.cells = [nb.cells[i] for i in stored]
    nb.cells.insert(0, guard_cell(package_root, module))
    first = [str(package_root)] if on_path else []
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [*first, os.environ.get("PYTHONPATH")]))}
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(BOOK)}})
    begin = time.perf_counter()
    try:
        client.execute(env=env)
    except CellExecutionError as error:
        failed = next(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
                      and any(o.output_type == "error" for o in cell.outputs))
        where = -1 if failed == 0 else stored[failed - 1]
        return Run(where, error.ename, error.evalue, time.perf_counter() - begin)
    return Run(None, "", "", time.perf_counter() - begin)


def test_the_guard_fails_when_the_kernel_imports_the_shared_tree(tmp_path):
    """Without the copy on PYTHONPATH the kernel imports the editable install of the shared
    tree, and the guard says so. (With it, PYTHONPATH wins over the editable finder on
    sys.meta_path: every test below asserts that its guard passed.)"""
    elsewhere = run_chapter("02_scaled_dot_product", mutated_copy(None, tmp_path), "attention.py",
                            stop_after=-1, on_path=False)
    assert (elsewhere.cell, elsewhere.ename) == (-1, "AssertionError"), elsewhere
    assert str(ROOT / "course_attn") in elsewhere.evalue


# Where each chapter's bugs were caught, for the controls: the file runs in one worker (pytest
# runs it in order; xdist's --dist loadfile keeps a file on one worker), the controls after the
# bugs. A control run without its bugs (-k) checks the whole chapter instead.
CAUGHT_AT: dict[str, list[int]] = {}


@pytest.mark.parametrize("bug", BUGS, ids=[bug.id for bug in BUGS])
def test_the_chapter_catches_the_bug(bug, tmp_path):
    run = run_chapter(bug.chapter, mutated_copy(bug, tmp_path), bug.module, cells=bug.cells)
    print(f"{bug.id}: book/{bug.chapter} stopped at cell {run.cell} "
          f"({run.ename}) after {run.seconds:.0f} s")
    assert run.cell != -1, (f"{bug.id}: the guard cell failed, not the chapter: {run.ename}: "
                            f"{run.evalue}")
    assert run.cell is not None, (f"book/{bug.chapter} ran to its end with the bug {bug.id} in "
                                  f"course_attn/{bug.module}")
    assert run.ename == "AssertionError", (
        f"{bug.id}: book/{bug.chapter} cell {run.cell} raised {run.ename}: {run.evalue}; a "
        "chapter catches a bug with an assert, not with an error of the code around it")
    if bug.cells is None:
        CAUGHT_AT.setdefault(bug.chapter, []).append(run.cell)



@pytest.mark.parametrize("chapter", sorted({bug.chapter for bug in BUGS if bug.cells is None}))
def test_the_unmutated_copy_passes_the_cells_that_caught_bugs(chapter, tmp_path):
    caught = CAUGHT_AT.get(chapter)
    last = max(caught) if caught else None
    run = run_chapter(chapter, mutated_copy(None, tmp_path), "attention.py", stop_after=last)
    print(f"control: book/{chapter} up to cell {last} in {run.seconds:.0f} s")
    assert run.cell is None, (f"book/{chapter}, unmutated, failed at cell {run.cell}: "
                              f"{run.ename}: {run.evalue}")


SUBSETS = sorted({(bug.chapter, bug.cells) for bug in BUGS if bug.cells is not None})


@pytest.mark.parametrize("chapter, cells", SUBSETS,
                         ids=[f"{chapter}-cells-{'-'.join(cells)}"
                              for chapter, cells in SUBSETS])
def test_the_unmutated_copy_passes_the_cells_that_bugs_run(chapter, cells, tmp_path):
    run = run_chapter(chapter, mutated_copy(None, tmp_path), "attention.py", cells=cells)
    print(f"control: book/{chapter}, cells {cells}, in {run.seconds:.0f} s")
    assert run.cell is None, (f"book/{chapter}, unmutated, cells {cells}, failed at cell "
                              f"{run.cell}: {run.ename}: {run.evalue}")
