"""Print TQL expressions back as text (for plans and messages).

>>> from trellisdb.tql import ast as A
>>> show(A.Binary("AND", A.Column("a"), A.Not(A.Literal("it's"))))
"(a AND NOT 'it''s')"
"""

from __future__ import annotations

from typing import Any

from trellisdb.tql import ast as A


def show(e: Any) -> str:
    if isinstance(e, A.Literal):
        v = e.value
        if v is None:
            return "NULL"
        if isinstance(v, bool):
            return "TRUE" if v else "FALSE"
        if isinstance(v, str):
            return "'" + v.replace("'", "''") + "'"
        return repr(v) if isinstance(v, int | float) else repr(str(v))
    if isinstance(e, A.Param):
        return f"${e.name}"
    if isinstance(e, A.Column):
        return e.name
    if isinstance(e, A.Call):
        return f"{e.name}({', '.join(show(a) for a in e.args)})"
    if isinstance(e, A.Neg):
        return f"-{show(e.operand)}"
    if isinstance(e, A.Binary):
        return f"({show(e.left)} {e.op} {show(e.right)})"
    if isinstance(e, A.BoolOp):
        return "(" + f" {e.op} ".join(show(o) for o in e.operands) + ")"
    if isinstance(e, A.Not):
        return f"NOT {show(e.operand)}"
    if isinstance(e, A.IsNull):
        return f"{show(e.operand)} IS {'NOT ' if e.negated else ''}NULL"
    if isinstance(e, A.InList):
        return f"{show(e.operand)} {'NOT ' if e.negated else ''}IN ({', '.join(show(i) for i in e.items)})"
    if isinstance(e, A.Between):
        return f"{show(e.operand)} BETWEEN {show(e.low)} AND {show(e.high)}"
    return str(e)
