"""Progress bars of long operations (materialize, refresh, export, compaction), on stderr.

``progress`` as the library methods take it: ``None`` shows a bar when stderr is a terminal
(never in captured or piped output), ``True`` / ``False`` always / never; ``export`` also takes
a callable ``progress(done, total)``, called instead of drawing a bar. The bars are tqdm's (as
``trellisdb/importers/units.py``'s), and vanish when done (``leave=False``).

>>> with Steps("materialize good", ("compute rows", "write"), progress=False) as step:
...     step("compute rows")
...     step("write")
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

#: What ``progress=`` may be: show a bar (None: when stderr is a terminal), or a callback.
Progress = bool | Callable[[int, int], None] | None


def shown(progress: Progress) -> bool:
    """Whether ``progress`` asks for a bar: True, or None with stderr a terminal."""
    if progress is None:
        return sys.stderr.isatty()
    return progress is True


def _bar(**kw: Any) -> Any:
    from tqdm import tqdm

    return tqdm(file=sys.stderr, leave=False, dynamic_ncols=True, **kw)


class Steps:
    """A bar over the named steps of one operation: ``step(label)`` finishes the step before it
    (if any) and shows ``label`` as the one running."""

    def __init__(self, desc: str, steps: Sequence[str], progress: Progress = None) -> None:
        self.desc = desc
        self.bar = _bar(desc=desc, total=len(steps), unit=" steps", disable=not shown(progress))
        self.started = False

    def __call__(self, label: str) -> None:
        if self.started:
            self.bar.update()
        self.started = True
        self.bar.set_description_str(f"{self.desc} ({label})")

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started and exc[0] is None:
            self.bar.update()
        self.bar.close()


def counted(desc: str, progress: Progress, unit: str = " rows", total: int = 0,
            ) -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    """``progress`` as a ``progress(done, total)`` callback (an export's rows, an embed's texts):
    the callable itself, a bar's (over ``unit``; ``total`` when known ahead, so the bar shows it
    and the time left from the start), or None; and what to call when the work ends (closes the
    bar)."""
    if callable(progress):
        return progress, lambda: None
    if not shown(progress):
        return None, lambda: None
    bar = _bar(desc=desc, total=total, unit=unit)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    return update, bar.close
