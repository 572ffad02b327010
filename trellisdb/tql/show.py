"""Print TQL expressions back as text (for plans and messages).

>>> from trellisdb.tql import ast as A
>>> show(A.Binary("AND", A.Column("a"), A.Not(A.Literal("it's"))))
"(a AND NOT 'it''s')"
"""

from __future__ import annotations

from typing import assert_never

from trellisdb.tql import ast as A


def show(e: A.Expr) -> str:
    match e:
        case A.Literal():
            v = e.value
            if v is None:
                return "NULL"
            if isinstance(v, bool):
                return "TRUE" if v else "FALSE"
            if isinstance(v, str):
                return "'" + v.replace("'", "''") + "'"
            return repr(v) if isinstance(v, int | float) else repr(str(v))
        case A.Param():
            return f"${e.name}"
        case A.Column():
            return e.name
        case A.Call():
            name = "attr" if e.name.startswith("attr_") else e.name  # attr's typed readings look as written
            return f"{name}({', '.join(show(a) for a in e.args)})"
        case A.AggCall():
            return f"{e.func}({'DISTINCT ' if e.distinct else ''}{'*' if e.arg is None else show(e.arg)})"
        case A.Neg():
            return f"-{show(e.operand)}"
        case A.Binary():
            return f"({show(e.left)} {e.op} {show(e.right)})"
        case A.BoolOp():
            return "(" + f" {e.op} ".join(show(o) for o in e.operands) + ")"
        case A.Not():
            return f"NOT {show(e.operand)}"
        case A.IsNull():
            return f"{show(e.operand)} IS {'NOT ' if e.negated else ''}NULL"
        case A.InList():
            return f"{show(e.operand)} {'NOT ' if e.negated else ''}IN ({', '.join(show(i) for i in e.items)})"
        case A.Between():
            return f"{show(e.operand)} BETWEEN {show(e.low)} AND {show(e.high)}"
        case _:
            assert_never(e)
