"""What an implementation exercise may run: ATen operations, by overload packet (``"aten.mul"``),
as torch dispatches them. The grader sends an exercise's list to the kernel; the guard in
``harness.py`` refuses, by name, any operation outside it, however the student reached it
(``torch.softmax``, ``Tensor.softmax``, ``torch._softmax``, ``torch.ops.aten._softmax``, a
``map`` over rows: every one runs ``aten._softmax``).

``ELEMENTARY`` is what any computation is made of: elementwise arithmetic and comparisons,
reductions, views and copies, creating tensors, a tensor's metadata (dtype promotion, sizes),
matrix products, indexing, concatenation, sorting. What it leaves out are the shortcuts the
course asks students to write themselves: the softmax family, attention kernels, normalisation
layers, ``logcumsumexp``. An exercise adds back a family it does not teach (``SOFTMAX`` where
softmax is an earlier chapter's tool).

Some shortcuts are composites that torch decomposes into elementary operations before
dispatching them (``F.rms_norm`` becomes pow, mean, rsqrt, mul; ``repeat_interleave`` becomes
expand and clone): those an exercise refuses by function name (``Exercise.banned``), which the
guard matches whatever route reached the function.
"""

import torch

_TAGGED = (torch.Tag.pointwise, torch.Tag.reduction)

# Built from names, not from tags, where tags do not say it (creation, linear algebra, indexing).
_CREATION = """empty empty_like empty_strided new_empty new_empty_strided new_zeros new_ones
new_full zeros zeros_like ones ones_like full full_like fill fill_ zero_ arange linspace logspace
eye
scalar_tensor lift_fresh lift_fresh_copy clone _to_copy copy copy_ _copy_from
_copy_from_and_resize resize_ contiguous _local_scalar_dense item equal is_nonzero is_same_size
_unsafe_view _reshape_copy view_copy expand_copy permute_copy transpose_copy unsqueeze_copy
squeeze_copy select_copy slice_copy alias_copy detach_copy t_copy rand rand_like randn
randn_like randint randint_like randperm normal normal_ uniform_ bernoulli bernoulli_ random_
exponential_ multinomial complex polar resolve_conj resolve_neg _conj _neg_view conj
_assert_async _assert_scalar _functional_assert_async _functional_assert_scalar detach_
squeeze_ unsqueeze_ t_ transpose_ as_strided_ _has_compatible_shallow_copy_type"""
_METADATA = """promote_types result_type can_cast is_floating_point is_complex is_signed
is_same_size numel size stride dim is_contiguous storage_offset is_set_to is_pinned _version
output_nr sym_size sym_stride sym_numel sym_storage_offset is_conj is_neg is_inference
is_leaf requires_grad_ retain_grad _is_zerotensor"""
_LINEAR_ALGEBRA = """mm bmm addmm addbmm baddbmm addmv mv dot vdot outer ger _addmm_activation
linear matmul kron block_diag diag diag_embed diagflat tensordot einsum _cdist_forward cdist"""
_INDEXING = """index index_select index_put index_put_ _index_put_impl_ index_add index_add_
index_copy index_copy_ index_fill index_fill_ gather scatter scatter_ scatter_add scatter_add_
scatter_reduce scatter_reduce_ masked_scatter masked_scatter_ masked_select masked_fill_ nonzero
nonzero_static take take_along_dim cat stack hstack vstack tril tril_ triu triu_ tril_indices
triu_indices roll flip fliplr flipud rot90 repeat tile constant_pad_nd narrow_copy
select_scatter slice_scatter diagonal_scatter as_strided_scatter sort argsort topk kthvalue
cummax cummin cumsum cumsum_ cumprod cumprod_ searchsorted bucketize _unique2 unique_dim
unique_consecutive bincount histc isin embedding one_hot where"""
# Arithmetic that torch does not tag pointwise: ``//`` on tensors (``div`` with
# ``rounding_mode="floor"``, which is tagged, computes the same).
_UNTAGGED_ARITHMETIC = "floor_divide floor_divide_"


def _operators() -> tuple[set[str], set[str]]:
    """Every ATen operator torch has registered (by name), and those among them that are
    elementwise, reductions or views by torch's own tags and schemas. Read from the dispatcher,
    not from ``torch.ops.aten``, which makes its packets lazily (listing it shows only the ones
    used so far)."""
    names, chosen = set(), set()
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::"):
            continue
        name, _, overload = full[len("aten::"):].partition(".")
        names.add(name)
        try:
            tags = torch._C._get_operation_overload(f"aten::{name}", overload)[2]
            returns = torch._C._get_schema(f"aten::{name}", overload).returns
        except (RuntimeError, IndexError, TypeError):
            continue
        aliased = returns and returns[0].alias_info is not None and \
            not returns[0].alias_info.is_write
        if aliased or any(tag in tags for tag in _TAGGED):
            chosen.add(name)
    return names, chosen


SOFTMAX = frozenset({"aten._softmax", "aten._safe_softmax", "aten._log_softmax",
                     "aten.logsumexp", "aten.softmax", "aten.log_softmax"})  # forward only
SOFTMAX_BACKWARD = frozenset({"aten._softmax_backward_data", "aten._log_softmax_backward_data"})
LOGCUMSUMEXP = frozenset({"aten.logcumsumexp", "aten._logcumsumexp"})

_NAMES, _TAGGED_OR_VIEWS = _operators()
_LISTED = set(f"{_CREATION} {_METADATA} {_LINEAR_ALGEBRA} {_INDEXING} "
              f"{_UNTAGGED_ARITHMETIC}".split())
ELEMENTARY = frozenset(f"aten.{name}" for name in _TAGGED_OR_VIEWS | _LISTED if name in _NAMES) \
    - SOFTMAX - SOFTMAX_BACKWARD - LOGCUMSUMEXP
NONE: frozenset = frozenset()  # an answer worked out with arithmetic: no tensor at all
ELU = frozenset({"aten.elu", "aten.elu_", "aten.celu", "aten.celu_", "aten.selu", "aten.selu_"})
GROWING = frozenset({"aten.cat", "aten.stack", "aten.hstack", "aten.vstack", "aten.resize_",
                     "aten.constant_pad_nd"})

# Shortcuts refused by name (``Exercise.banned``), shared by the chapters that teach them:
# "course_attn" refuses the package's code, so neither the reference nor a sibling answers.
NO_LIBRARY_ATTENTION = ("course_attn", "torch.nn.functional.scaled_dot_product_attention",
                        "torch.nn.MultiheadAttention.forward",
                        "torch.nn.functional.multi_head_attention_forward",
                        "torch.nn.attention.flex_attention.flex_attention",
                        "torch.nn.attention.flex_attention.create_block_mask")
NO_LIBRARY_SOFTMAX = ("torch.softmax", "torch.Tensor.softmax", "torch.nn.functional.softmax",
                      "torch.special.softmax", "scipy.special.softmax")
NO_LIBRARY_MASKS = ("course_attn", "torch.nn.attention.bias.causal_lower_right",
                    "torch.nn.attention.bias.causal_upper_left",
                    "torch.nn.attention.bias.CausalBias.__init__",
                    "torch.nn.attention.flex_attention.create_block_mask",
                    "torch.nn.attention.flex_attention.create_mask")


def refuses_softmax(banned) -> bool:
    """Whether an exercise that refuses these function names refuses the softmax family."""
    return any(name.rsplit(".", 1)[-1].lstrip("_") in ("softmax", "log_softmax", "logsumexp")
               for name in banned)


def default_operations(banned) -> frozenset:
    """The operations of an implementation exercise that declares none: the elementary ones,
    and the softmax family unless the exercise refuses softmax by name."""
    return ELEMENTARY if refuses_softmax(banned) else ELEMENTARY | SOFTMAX


def guard_options(exercise, package: str | None, *, imports: bool = True) -> dict:
    """What the guard needs for ``exercise`` (``harness.Guard``'s arguments, as plain data):
    the operations it may run; the functions it refuses by name (``refused``: torch's
    functions, matched by name whatever the route; ``functions``: Python functions, matched by
    where their code is); the package folder whose code it may not run (``package``, where the
    exercise bans ``"course_attn"``) and the package's functions it may run all the same
    (``allowed``: file relative to the package, and qualified name); the arguments it may not
    copy (``no_copy``: position and name); the positions of q, k and the block size of a tiled
    computation, which may not make a whole (Tq, Tk) table (``no_table``); the arguments a
    one-pass computation reads once (``read_once``); what a cached generation may run through
    its weights (``feeds``). Without ``imports``, a
    refused function whose module is not imported yet is left out (``check()`` in a notebook
    need not import torch's compiler to refuse a function the notebook never imported; the
    grader imports them all)."""
    from pathlib import Path
    here = Path(__file__).resolve().parents[1]  # the package this process imported
    allowed = []
    for dotted in exercise.allowed:
        code = _code_of(dotted)
        if code is not None:
            allowed.append([str(Path(code.co_filename).resolve().relative_to(here)),
                            getattr(code, "co_qualname", code.co_name)])
    functions = []
    for dotted in exercise.banned:
        code = _code_of(dotted, imports) if dotted != "course_attn" else None
        if code is not None:
            functions.append([code.co_filename, getattr(code, "co_qualname", code.co_name),
                              dotted])
    ops = exercise.operations()
    return {"ops": None if ops is None else sorted(ops),
            "refused": [name for name in exercise.banned if name != "course_attn"],
            "functions": functions,
            "package": package if "course_attn" in exercise.banned else None,
            "allowed": allowed,
            "no_copy": [list(item) for item in exercise.no_copy],
            "no_table": list(exercise.no_table) if exercise.no_table else None,
            "read_once": [list(item) for item in exercise.read_once],
            "feeds": list(exercise.feeds) if exercise.feeds else None}


def _code_of(dotted: str, imports: bool = True):
    """The code object of the Python function a dotted name names (unwrapped), or None (a
    builtin, or a name that does not resolve here; without ``imports``, one whose module is
    not imported yet)."""
    import importlib
    import sys
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module = ".".join(parts[:split])
        if not imports and module not in sys.modules:
            continue
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return None
        while hasattr(obj, "__wrapped__"):
            obj = obj.__wrapped__
        return getattr(obj, "__code__", None)
    return None
