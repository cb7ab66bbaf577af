"""Functions of Python source by `ast`: their text, their signature (`def name(args):`, the
arguments by `ast.unparse`), and wrong versions of a signature for preference pairs.

A corruption is one of: "name" (another function's name), "drop" (one argument left out, with
its default), "rename" (one argument renamed); each result still parses and differs from the
signature it came from.
"""

import ast
import copy
import random
import re
import textwrap

_EOL = re.compile(r"(\r\n|\r|\n)")


def functions(source: str, with_text: bool = True):
    """(node, text) of every function and method of `source`: the text as
    `ast.get_source_segment(source, node, padded=True)` gives it, dedented (read from lines
    split once, where get_source_segment splits the whole file again for every node)."""
    tree = ast.parse(source)
    lines = _EOL.split(source)  # as ast does: only \r\n, \r and \n end a line (not \f, \x1c...)
    lines = [a + b for a, b in zip(lines[::2], [*lines[1::2], ""])]
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not with_text:
            yield node, ""
            continue
        # Offsets are in UTF-8 bytes, as in get_source_segment.
        part = [line.encode() for line in lines[node.lineno - 1 : node.end_lineno]]
        part[-1] = part[-1][: node.end_col_offset]
        part[0] = b" " * node.col_offset + part[0][node.col_offset :]
        yield node, textwrap.dedent(b"".join(part).decode())


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef, args: ast.arguments | None = None):
    """`def name(args):` of a function (`async def` for a coroutine), by `ast.unparse`."""
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{prefix} {node.name}({ast.unparse(args or node.args)}):"


def all_args(args: ast.arguments) -> list[ast.arg]:
    extra = [a for a in (args.vararg, args.kwarg) if a is not None]
    return [*args.posonlyargs, *args.args, *args.kwonlyargs, *extra]


def corrupt_signature(
    sig: str, names: list[str], arg_names: list[str], rng: random.Random
) -> tuple[str, str]:
    """(kind, a wrong version of the signature `sig`): "name" another function's name from
    `names`, "drop" one argument left out, or "rename" one argument renamed to another from
    `arg_names` (or with "_value" added); the kind is drawn from those that apply. The result
    parses and differs from `sig`."""
    node = ast.parse(sig + " ...").body[0]
    kinds = ["name"] if any(n != node.name for n in names) else []
    if all_args(node.args):
        kinds += ["drop", "rename"]
    if not kinds:
        raise ValueError(f"cannot corrupt {sig!r}: no argument, and no other name to swap in")
    kind = rng.choice(kinds)
    new = copy.deepcopy(node.args)
    if kind == "name":
        node = copy.copy(node)
        node.name = rng.choice([n for n in names if n != node.name])
    elif kind == "drop":
        _drop_arg(new, rng)
    else:
        taken = {a.arg for a in all_args(new)}
        target = rng.choice(all_args(new))
        pool = [n for n in arg_names if n not in taken]
        target.arg = rng.choice(pool) if pool else target.arg + "_value"
    return kind, signature(node, new)


def _drop_arg(args: ast.arguments, rng: random.Random) -> None:
    """Remove one argument of `args` in place, with its default."""
    positional = [*args.posonlyargs, *args.args]
    choices = [("pos", i) for i in range(len(positional))]
    choices += [("kw", i) for i in range(len(args.kwonlyargs))]
    choices += [(name, 0) for name in ("vararg", "kwarg") if getattr(args, name) is not None]
    where, i = rng.choice(choices)
    if where == "pos":
        first_default = len(positional) - len(args.defaults)
        if i >= first_default:
            del args.defaults[i - first_default]
        if i < len(args.posonlyargs):
            del args.posonlyargs[i]
        else:
            del args.args[i - len(args.posonlyargs)]
    elif where == "kw":
        del args.kwonlyargs[i]
        del args.kw_defaults[i]
    else:
        setattr(args, where, None)
