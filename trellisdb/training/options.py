"""The options of a training-data view, every kind's, in one flat record.

``ViewOptions`` is what the kinds (``trellisdb/training/kinds/``) read; ``ViewSpec``
(``spec.py``) is the same record, checked, with its catalog and text forms. Each kind
names the options it reads beyond the common ones (``ViewKind.options``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The edge kinds a view follows by default (``via``): a node's parents in the lineage.
LINEAGE = ("derived_from", "repair_of", "crossover_of")


@dataclass(frozen=True)
class ViewOptions:
    """A view's definition. ``where`` and ``reward`` are TQL expressions over nodes."""

    name: str
    kind: str
    reward: str | None = None
    where: str | None = None
    threshold: float | None = None
    group_by: str = "parent"  # parent | prompt
    margin: float = 0.0
    pairs_from: tuple[str, ...] = ("siblings", "comparisons")
    min_size: int = 2
    drop_zero_variance: bool = False
    size: int | None = None
    strategy: str = "advantage"  # replay: advantage | bucket
    seed: int = 0
    entropy: str | None = None  # replay, bucket: the reward channel holding a node's entropy
    prompt: str = "prompt"
    response: str = "response"
    system: str = "system_prompt"
    via: tuple[str, ...] = LINEAGE
    path: bool = False  # sft: the root-to-node path as a multi-turn conversation
    #: sft: the artifact holding a node's chat turns (a JSON array of {role, content}), exported
    #: as they are instead of system/prompt/response turns (None: those)
    messages: str | None = None
    #: keep the texts the rows name beside them (``texts.py``): exports read them instead of
    #: resolving them from the artifacts each time, for a copy of the texts on disk
    keep_texts: bool = True
    #: select the nodes quarantined as of the view's commit too (by default a view leaves them out,
    #: as if its ``where`` did: ``docs/data-model.md``, Provenance and trust)
    include_quarantined: bool = False
