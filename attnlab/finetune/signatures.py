"""Functions of Python source by `ast`: their text, their signature (`def name(args):`, the
arguments by `ast.unparse`), and wrong versions of a signature for preference pairs.

A corruption is one of: "name" (another function's name), "drop" (one argument left out, with
its default), "rename" (one argument renamed), "add" (one argument added) or "swap" (two
arguments' names exchanged, so their order changes); each result still parses and differs from
the signature it came from. The built-in DPO pairs draw from the first three (KINDS); the
"spec -> signature" pairs from all five (SPEC_KINDS), on bare signatures (`bare_signature`).
"""

import ast
import copy
import random
import re
import textwrap

_EOL = re.compile(r"(\r\n|\r|\n)")
KINDS = ("name", "drop", "rename")
SPEC_KINDS = ("name", "drop", "add", "rename", "swap")


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


def bare_signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """`def name(args):` with the arguments' names and kinds alone (`/`, `*args`, `*`,
    `**kwargs` kept; no defaults, no annotations): all that a spec naming them decides."""
    args = copy.deepcopy(node.args)
    args.defaults, args.kw_defaults = [], [None] * len(args.kwonlyargs)
    for a in all_args(args):
        a.annotation = None
    return signature(node, args)


def applicable_kinds(sig: str, names: list[str], kinds=KINDS) -> list[str]:
    """The corruptions among `kinds` that can change `sig`: "name" needs another name in
    `names`, "drop" and "rename" an argument, "swap" two of them; "add" always applies."""
    node = ast.parse(sig + " ...").body[0]
    n_args = len(all_args(node.args))
    need = {"name": any(n != node.name for n in names), "drop": n_args >= 1, "add": True}
    need |= {"rename": n_args >= 1, "swap": n_args >= 2}
    return [k for k in kinds if need[k]]


def corrupt_signature(
    sig: str, names: list[str], arg_names: list[str], rng: random.Random, kinds=KINDS
) -> tuple[str, str]:
    """(kind, a wrong version of the signature `sig`), the kind drawn from those of `kinds`
    that apply (`applicable_kinds`): "name" another function's name from `names`, "drop" one
    argument left out, "rename" one argument renamed to another from `arg_names` (or with
    "_value" added), "add" one such argument added, "swap" two arguments' names exchanged.
    The result parses and differs from `sig`."""
    node = ast.parse(sig + " ...").body[0]
    usable = applicable_kinds(sig, names, kinds)
    if not usable:
        raise ValueError(f"cannot corrupt {sig!r} with {list(kinds)}")
    kind = rng.choice(usable)
    new = copy.deepcopy(node.args)
    taken = {a.arg for a in all_args(new)}
    pool = [n for n in arg_names if n not in taken]
    if kind == "name":
        node = copy.copy(node)
        node.name = rng.choice([n for n in names if n != node.name])
    elif kind == "drop":
        _drop_arg(new, rng)
    elif kind == "rename":
        target = rng.choice(all_args(new))
        target.arg = rng.choice(pool) if pool else target.arg + "_value"
    elif kind == "add":
        _add_arg(new, rng.choice(pool) if pool else "extra_value", rng)
    else:
        a, b = rng.sample(all_args(new), 2)  # two names: a signature never repeats one
        a.arg, b.arg = b.arg, a.arg
    return kind, signature(node, new)


def _add_arg(args: ast.arguments, name: str, rng: random.Random) -> None:
    """Insert an argument `name` in place: a positional one where no default is due (before
    the first one with a default), else a keyword-only one."""
    room = len(args.args) - len(args.defaults)  # args.args without a default
    if room >= 0:
        args.args.insert(rng.randint(0, room), ast.arg(name))
    else:  # defaults reach into the positional-only arguments
        args.kwonlyargs.append(ast.arg(name))
        args.kw_defaults.append(None)


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
