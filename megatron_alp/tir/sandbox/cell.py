"""The program that runs the model's code like a notebook cell, in an interpreter of its own.

Once an execution is confined, the confinement program (:mod:`.confine`) execs ``python -I -u -c
<bootstrap> FD``, FD being a memfd that holds this program (compiled) and then the code; the
bootstrap runs the program, which reads the code. The interpreter that runs the code never held
the spec, the status descriptor or anything else of the set-up, so its frames, objects and memory
show none of it (host paths, the trainer's pid). Standard library only, and no more of it than a
cell needs (``_ast``, not ``ast``; ``traceback`` only on an error): the imports are most of an
execution's time.
"""

import _ast
import linecache
import os
import sys


def main() -> int:
    """Run the code; print the value of a last expression, and a traceback without this program's
    frames on error. The exit status is the code's."""
    with os.fdopen(int(sys.argv[1]), "rb") as f:
        code = f.read().decode("utf-8", "surrogatepass")
    del sys.argv[1:]
    own_file = main.__code__.co_filename
    linecache.cache["<code>"] = (len(code), None, code.splitlines(keepends=True), "<code>")
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = compile(code, "<code>", "exec", _ast.PyCF_ONLY_AST)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), scope)
        if last is not None:
            value = eval(compile(_ast.Expression(last.value), "<code>", "eval"), scope)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code)
        return 1
    except BaseException as e:  # noqa: BLE001 - the code's own errors are its output
        import traceback

        tb = traceback.TracebackException(type(e), e, e.__traceback__)
        tb.stack = traceback.StackSummary.from_list([f for f in tb.stack if f.filename != own_file])
        sys.stdout.flush()
        print("".join(tb.format()), end="", file=sys.stdout)
        return 1
    finally:
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass


if __name__ == "__main__":
    sys.exit(main())
